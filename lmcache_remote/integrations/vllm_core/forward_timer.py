"""ForwardTimer: how long a step's forward took on a worker, less the connector's own hooks.

The load decision weighs loading a hit against this engine's own prefill speed
(`telemetry.figures.PrefillFigures`), which the workers measure step by step:

- `begin(step)` when vLLM binds the step's metadata (before the forward): `step` is the
  scheduler's (tokens computed, their summed context); steps of fewer than `MIN_STEP_TOKENS`
  tokens (decode) are not timed;
- `own()`, a context manager around each of the connector's hooks that run inside the forward
  (loads, layer-wise copies): their time is the connector's, not the model's (nested uses
  count once);
- `end()` when the forward is over (vLLM calls `wait_for_save` after it);
- `take()`: the last timed step's (tokens, work, seconds), once, or None.

On CUDA the host times what it waited, which the kernels may outlast (untested: no GPU here).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from lmcache_remote.telemetry.figures import MIN_STEP_TOKENS


class ForwardTimer:
    """One worker's step timing; see the module docstring. Used from vLLM's worker thread."""

    def __init__(self) -> None:
        self._step: tuple[int, float] | None = None  # (tokens, work) of the step under way
        self._start = 0.0
        self._own = 0.0  # seconds spent in the connector's hooks during the forward
        self._depth = 0
        self._done: tuple[int, float, float] | None = None

    def begin(self, step: tuple[int, float] | None) -> None:
        self._step = step if step and step[0] >= MIN_STEP_TOKENS else None
        self._start = time.perf_counter()
        self._own = 0.0

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self._own += time.perf_counter() - start

    def end(self) -> None:
        if self._step is None:
            return
        seconds = time.perf_counter() - self._start - self._own
        if seconds > 0:
            self._done = (self._step[0], self._step[1], seconds)
        self._step = None

    def take(self) -> tuple[int, float, float] | None:
        done, self._done = self._done, None
        return done
