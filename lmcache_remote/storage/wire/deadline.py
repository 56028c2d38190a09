"""The deadline of the remote call under way: `remote_timeout` bounds the whole of a call.

A socket timeout bounds one wait: on a link that delivers slowly rather than not at all, a read
of 8 MiB with `remote_timeout` 1 s took 11 s, each wait well inside its second. So a call
carries an absolute deadline: `call_deadline(seconds)` (entered by `RemoteCaller.call` for
each call, and by a tier's `get` for the whole of a read over several lanes) sets it for the
code inside, in this thread and in every task that runs in a copy of this context (the read
lanes do); a deadline already set and sooner wins. The bulk path (both readers) cuts every
wait to what is left and fails the batch with a timeout once it has passed.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

__all__ = ["call_deadline", "current"]

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("lmcr_deadline",
                                                                         default=None)


@contextlib.contextmanager
def call_deadline(seconds: float) -> Iterator[None]:
    """The code inside ends within ``seconds`` from now, or by the enclosing call's deadline
    if that is sooner."""
    outer = _DEADLINE.get()
    mine = time.monotonic() + seconds
    token = _DEADLINE.set(mine if outer is None else min(outer, mine))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def current() -> float | None:
    """The deadline (`time.monotonic()`) of the call under way, or None."""
    return _DEADLINE.get()
