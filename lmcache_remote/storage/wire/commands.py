"""The commands of the Redis tiers, apart from the tiers themselves.

What the chunk tier and the page store on any channel (and the admin transfer and the access
check) share:
the one atomic command that writes a chunk or a page (`chunk_write_command`, `write_batch`),
its routing key (`command_key`) and the expiry it sets (`ttl_ms`), the checks of a
transaction's replies, and the small readers of a chunk's replies (`regroup`,
`listed_part_count`). How a batch is cut into windows and how many bytes are in flight is
`windows`. Nothing here talks to Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import BackendError, CorruptEntryError
from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.values.value_format import HEADER_FIXED, MAGIC, known_version

#: Writes every part of a chunk with the same expiry in one atomic step (a script runs whole).
SET_PARTS_PX = (
    "for i = 1, #KEYS do redis.call('SET', KEYS[i], ARGV[i], 'PX', ARGV[#KEYS + 1]) end "
    "return #KEYS"
)


def ttl_ms(config: CacheConfig) -> int | None:
    """The expiry every value is written with (`remote_ttl`, in ms), None for none."""
    return None if config.remote_ttl is None else int(config.remote_ttl * 1000)


def chunk_write_command(keys: Sequence[str], values: Sequence[Any], ttl_ms: int | None,
                        *, script: bool = False) -> tuple[Any, ...]:
    """The one command that writes a chunk's values under its keys atomically (see above).

    A chunk of several values names them last part first and value 0 (the header) last: the
    native loop then hashes each part as it sends it and seals the header after them all
    (`wire.Seal`), where header first would need every part hashed before any is sent.
    `command_key` finds the chunk key in any form. `script` forces the EVAL form (the access
    check probes it even for a one-value chunk)."""
    last_first_keys, last_first_values = keys[::-1], values[::-1]
    if script and ttl_ms is not None:
        return ("EVAL", SET_PARTS_PX, len(keys), *last_first_keys, *last_first_values, ttl_ms)
    if len(keys) == 1:
        return ("SET", keys[0], values[0]) if ttl_ms is None else (
            "SET", keys[0], values[0], "PX", ttl_ms)
    if ttl_ms is None:
        return ("MSET", *(x for kv in zip(last_first_keys, last_first_values, strict=True)
                          for x in kv))
    return ("EVAL", SET_PARTS_PX, len(keys), *last_first_keys, *last_first_values, ttl_ms)


def chunk_write_commands(keys: Sequence[str], values: Sequence[Any], ttl_ms: int | None
                         ) -> tuple[list[tuple[Any, ...]], int]:
    """The commands that write a chunk's values atomically on one connection, and the index
    of the one that carries the values (its seal's command). A chunk of several values with an
    expiry is ``MULTI``, the `chunk_write_command` ``MSET``, a ``PEXPIRE`` per key, ``EXEC``:
    one transaction, so that no value is ever left without its expiry, as fast as a plain
    ``MSET`` (the ``EVAL`` form copies every value into the script's arguments and wrote 32 MiB
    chunks at 0.32x the ``MSET``'s speed, docs/benchmarks.md). Every other chunk is
    the one `chunk_write_command`. A cluster's tier keeps the single command (its scatter
    routes each command by its key; ``MULTI`` has none)."""
    if ttl_ms is None or len(keys) == 1:
        return [chunk_write_command(keys, values, ttl_ms)], 0
    return ([("MULTI",), chunk_write_command(keys, values, None),
             *(("PEXPIRE", key, ttl_ms) for key in keys), ("EXEC",)], 1)


def write_batch(batch: Sequence[tuple[Sequence[str], Sequence[Any]]],
                seals: Sequence[Any] | None, ttl_ms: int | None
                ) -> tuple[list[tuple[Any, ...]], list[Any] | None, list[int]]:
    """The commands of a single server's write of several chunks (or pages), each written by
    `chunk_write_commands`; each chunk's seal moved to the command that carries its values;
    and the index of every EXEC, whose reply `check_transactions` checks."""
    commands: list[tuple[Any, ...]] = []
    command_seals: list[Any] = []
    execs: list[int] = []
    for i, (keys, values) in enumerate(batch):
        chunk_commands, sealed = chunk_write_commands(keys, values, ttl_ms)
        if len(chunk_commands) > 1:
            execs.append(len(commands) + len(chunk_commands) - 1)
        command_seals.extend(seals[i] if seals is not None and j == sealed else None
                             for j in range(len(chunk_commands)))
        commands.extend(chunk_commands)
    return commands, command_seals if seals is not None else None, execs


def check_transactions(replies: Sequence[Any], execs: Sequence[int]) -> None:
    """Raises `BackendError` when a chunk's transaction failed (its EXEC's reply)."""
    for index in execs:
        failure = transaction_failure(replies[index])
        if failure is not None:
            raise BackendError(f"a chunk's write failed inside its transaction: {failure}")


def transaction_failure(reply: Any) -> BaseException | None:
    """The error an ``EXEC`` reply holds (an aborted transaction is None or an error; a
    command that failed inside it an error element), else None."""
    if reply is None:
        return BackendError("the chunk's transaction was aborted")
    if isinstance(reply, BaseException):
        return reply
    if isinstance(reply, list):
        for item in reply:
            if isinstance(item, BaseException):
                return item
    return None


def command_key(command: Sequence[Any]) -> Any:
    """The chunk key of a `chunk_write_command` (its value 0's; every key of a chunk routes
    to the same cluster slot)."""
    if command[0] == "EVAL":
        return command[2 + int(command[2])]
    return command[-2] if command[0] == "MSET" else command[1]


class IncompleteChunkError(CorruptEntryError):
    """A chunk's head is there but a part is gone: eviction or expiry, not damage."""


def regroup(flat: Sequence[Any], key_lists: Sequence[Sequence[str]]) -> list[list[Any]]:
    """One list of replies per chunk, from the replies of all its keys in a row."""
    out, pos = [], 0
    for keys in key_lists:
        out.append(list(flat[pos:pos + len(keys)]))
        pos += len(keys)
    return out


def listed_part_count(spec: ChunkSpec, head: Any) -> int | None:
    """The part count a chunk's fixed header lists, if the header is one of this format for
    this chunk (magic, version, token count and chunk hash); None otherwise (`get` would not
    serve it either). The rest of the header is checked when the chunk is read."""
    if not isinstance(head, bytes) or len(head) < HEADER_FIXED.size:
        return None
    fields = HEADER_FIXED.unpack_from(head)
    magic, version, num_tokens, chunk_hash, part_count = (
        fields[0], fields[1], fields[13], fields[14], fields[17])
    if (magic != MAGIC or not known_version(version) or num_tokens != spec.num_tokens
            or chunk_hash != spec.key.hash_bytes or part_count < 1):
        return None
    return int(part_count)
