"""Pins: chunks Redis never evicts while they are pinned, within a fleet-wide byte budget.

How (docs/pins.md; the keys in docs/key-schema.md, "Pins"): under a `volatile-*`
maxmemory-policy Redis evicts only keys that have an expiry. Every engine writes its values
with `remote_ttl` (30 days by default); pinning a chunk removes the expiry of each of its
values (PERSIST), so Redis never evicts it, and unpinning gives them `remote_ttl` again
(PEXPIRE). Everything else stays an LRU cache that evicts.

The registry is one hash, `keys.pins_key(prefix)`: a field per pinned chunk (its value-0 key
relative to the prefix) holding `bytes:until_ms:parts` (`until_ms` 0: no end; a request's
retention ends), and the field `#bytes`, the sum. Three scripts change it atomically: `pin`
(refused whole, `PinRefused`, when the chunks new to it would take the sum past the budget),
`unpin`, and `sweep` (the pins whose end has passed). The values' expiries are changed after
the script, in one pipeline (per node on a cluster): a chunk whose value 0 is gone when pinned
leaves the registry again. `sweep` runs where pins are listed or changed, and every
`SWEEP_INTERVAL` in each engine's stats publisher, so a request's retention ends within that
of its time even when nobody looks.

`Pins` works over any redis-py client (a `redis.Redis` or a `RedisCluster`, whose `eval` and
pipeline route by key); `call` bounds each round trip (the engine's `RemoteCaller`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lmcache_remote.errors import BackendError
from lmcache_remote.naming.keys import PART_SEP, absolute_key, pins_key, relative_key

#: Seconds between the sweeps an engine's stats publisher runs (`Pins.sweep`).
SWEEP_INTERVAL = 30.0
TOTAL_FIELD = "#bytes"

_PIN = """
local total = tonumber(redis.call('HGET', KEYS[1], '#bytes') or '0')
local add = 0
for i = 2, #ARGV, 4 do
  if not redis.call('HGET', KEYS[1], ARGV[i]) then add = add + tonumber(ARGV[i + 1]) end
end
if add > 0 and total + add > tonumber(ARGV[1]) then return {0, total, add} end
for i = 2, #ARGV, 4 do
  local b, u, p = ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
  local old = redis.call('HGET', KEYS[1], ARGV[i])
  if old then
    local ob, ou, op = string.match(old, '^(%d+):(%d+):(%d+)$')
    ou = tonumber(ou)
    if ou == 0 or u == 0 then u = 0 elseif ou > u then u = ou end
    b, p = ob, op
  end
  redis.call('HSET', KEYS[1], ARGV[i], b .. ':' .. string.format('%d', u) .. ':' .. p)
end
redis.call('HSET', KEYS[1], '#bytes', string.format('%d', total + add))
return {1, total + add, add}
"""

_UNPIN = """
local total = tonumber(redis.call('HGET', KEYS[1], '#bytes') or '0')
local out = {}
for i = 1, #ARGV do
  local old = redis.call('HGET', KEYS[1], ARGV[i])
  if old then
    redis.call('HDEL', KEYS[1], ARGV[i])
    total = total - tonumber(string.match(old, '^(%d+):'))
    out[#out + 1] = ARGV[i]
    out[#out + 1] = old
  end
end
if total < 0 then total = 0 end
redis.call('HSET', KEYS[1], '#bytes', string.format('%d', total))
return out
"""

_SWEEP = """
local now = tonumber(ARGV[1])
local all = redis.call('HGETALL', KEYS[1])
local total = 0
local out = {}
for i = 1, #all, 2 do
  local f, v = all[i], all[i + 1]
  if f ~= '#bytes' then
    local b, u = string.match(v, '^(%d+):(%d+):')
    u = tonumber(u)
    if u > 0 and u <= now then
      redis.call('HDEL', KEYS[1], f)
      out[#out + 1] = f
      out[#out + 1] = v
    else
      total = total + tonumber(b)
    end
  end
end
if #all > 0 then redis.call('HSET', KEYS[1], '#bytes', string.format('%d', total)) end
return out
"""


class PinRefused(BackendError):
    """A pin that would take the pinned bytes past the pin budget; nothing was pinned."""


@dataclasses.dataclass(frozen=True)
class PinTarget:
    """A chunk to pin: its value-0 key (absolute), how many values it has, its bytes."""

    key: str
    parts: int
    nbytes: int

    def value_keys(self) -> list[str]:
        return [self.key] + [f"{self.key}{PART_SEP}{i}" for i in range(1, self.parts)]


@dataclasses.dataclass(frozen=True)
class Pin:
    """A registry entry: the pinned chunk, and when its pin ends (None: never)."""

    target: PinTarget
    until: float | None


class Pins:
    """The pin registry under one prefix; see the module doc. Thread-safe (each call is a
    round trip or two on the client's pool)."""

    def __init__(self, client: Callable[[], Any], prefix: str, budget_bytes: int,
                 ttl_ms: int | None, call: Callable[[Callable[[], Any]], Any] | None = None
                 ) -> None:
        self._client = client
        self.prefix = prefix
        self.key = pins_key(prefix)
        self.budget_bytes = budget_bytes
        self._ttl_ms = ttl_ms
        self._call: Callable[[Callable[[], Any]], Any] = call or (lambda fn: fn())

    def pin(self, targets: Iterable[PinTarget], until: float | None = None) -> int:
        """Pin `targets` (until the wall-clock time `until`, or for ever); the bytes newly
        pinned. A chunk already pinned keeps its bytes and gets the later end. Raises
        `PinRefused` (nothing pinned) when the chunks new to the registry would take it past
        the budget."""
        unique = {t.key: t for t in targets}
        if not unique:
            return 0
        until_ms = 0 if until is None else max(1, int(until * 1000))
        args: list[Any] = [self.budget_bytes]
        for t in unique.values():
            args += [relative_key(self.prefix, t.key), t.nbytes, until_ms, t.parts]
        ok, total, added = self._call(
            lambda: self._client().eval(_PIN, 1, self.key, *args))
        if not int(ok):
            raise PinRefused(
                f"pinning {len(unique)} chunks ({_size(int(added))} not yet pinned) would take "
                f"the pinned bytes from {_size(int(total))} past the pin budget "
                f"{_size(self.budget_bytes)}: unpin something (lmcache-remote unpin) or raise "
                "pin_budget")
        gone = self._set_expiry(list(unique.values()), persist=True)
        if gone:
            self.unpin(gone)
        return int(added)

    def unpin(self, keys: Sequence[str]) -> list[PinTarget]:
        """Unpin the chunks of these value-0 keys (absolute): their values get `remote_ttl`
        again; the targets that were pinned."""
        if not keys:
            return []
        fields = [relative_key(self.prefix, k) for k in dict.fromkeys(keys)]
        flat = self._call(lambda: self._client().eval(_UNPIN, 1, self.key, *fields))
        removed = self._targets(flat)
        self._set_expiry(removed, persist=False)
        return removed

    def sweep(self, now: float | None = None) -> int:
        """End the pins whose time has passed (their values get `remote_ttl` again); how
        many ended."""
        now_ms = int((time.time() if now is None else now) * 1000)
        flat = self._call(lambda: self._client().eval(_SWEEP, 1, self.key, now_ms))
        ended = self._targets(flat)
        self._set_expiry(ended, persist=False)
        return len(ended)

    def entries(self) -> dict[str, Pin]:
        """Every pin, by value-0 key (absolute)."""
        raw = self._call(lambda: self._client().hgetall(self.key))
        out: dict[str, Pin] = {}
        for field, value in raw.items():
            name = field.decode() if isinstance(field, bytes) else field
            if name == TOTAL_FIELD:
                continue
            pin = _parse(absolute_key(self.prefix, name), value)
            out[pin.target.key] = pin
        return out

    def pinned_bytes(self) -> int:
        """The registry's sum of pinned bytes."""
        value = self._call(lambda: self._client().hget(self.key, TOTAL_FIELD))
        return int(value or 0)

    def _targets(self, flat: Sequence[Any]) -> list[PinTarget]:
        out = []
        for i in range(0, len(flat), 2):
            name = flat[i].decode() if isinstance(flat[i], bytes) else flat[i]
            out.append(_parse(absolute_key(self.prefix, name), flat[i + 1]).target)
        return out

    def _set_expiry(self, targets: Sequence[PinTarget], *, persist: bool) -> list[str]:
        """PERSIST (pin) or PEXPIRE to `remote_ttl` (unpin) every value of `targets`; when
        pinning, the value-0 keys that are gone (their chunks are not there to pin)."""
        if not targets or (not persist and self._ttl_ms is None):
            return []

        def op() -> list[Any]:
            pipe = self._client().pipeline(transaction=False)
            for t in targets:
                for key in t.value_keys():
                    if persist:
                        pipe.persist(key)
                    else:
                        pipe.pexpire(key, self._ttl_ms)
                if persist:
                    pipe.exists(t.key)
            return list(pipe.execute(raise_on_error=False))

        replies = self._call(op)
        for reply in replies:
            if isinstance(reply, Exception):
                raise BackendError(f"pins: {reply}")
        if not persist:
            return []
        gone, pos = [], 0
        for t in targets:
            pos += t.parts
            if not int(replies[pos]):
                gone.append(t.key)
            pos += 1
        return gone


def _parse(key: str, value: Any) -> Pin:
    text = value.decode() if isinstance(value, bytes) else str(value)
    nbytes, until_ms, parts = (int(x) for x in text.split(":"))
    return Pin(PinTarget(key, parts, nbytes), None if until_ms == 0 else until_ms / 1000)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"

