"""Types of the native receive loop (lmcache_remote/_wire.c); see storage/wire.py."""

from collections.abc import Callable
from typing import Any

def run_batch(
    fd: int,
    timeout: float,
    commands: list[bytes],
    reply_sizes: list[int] | None,
    inflight: int,
    sink: Callable[[int, int], Any] | None,
    make_error: Callable[[str], Exception],
) -> list[Any]: ...

def address(buffer: Any) -> int: ...
