"""Types of the C extension lmcache_remote.native._wire (the `_wire*.c` sources beside this
file): the RESP loop (run_batch, see storage/wire/bulk.py), the row copier (copy_rows, see
connectors/rows.py), the bound XXH3-64 (bind_xxh3, xxh3) and `address`."""

from collections.abc import Callable
from typing import Any

def run_batch(
    fd: int,
    timeout: float,
    commands: list[Any],
    reply_sizes: list[int] | None,
    inflight: int,
    sink: Callable[[int, int], Any] | list[Any] | None,
    make_error: Callable[[str], Exception],
    digests: list[int | None] | None = None,
    seals: list[Any] | None = None,
    max_bulk: int = ...,
    deadline_in: float = ...,
) -> list[Any]: ...

def copy_rows(jobs: list[tuple[int, int, int, int, Any]], gather: bool) -> None: ...
def bind_xxh3(path: str) -> bool: ...
def xxh3(buffer: Any) -> int: ...

def address(buffer: Any) -> int: ...
