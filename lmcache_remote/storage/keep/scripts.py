"""The keep policy's scripts: each runs whole on the server, on the one slot of the keep keys
(`naming.keys.keep_key`), so that several engines change the fleet's keep state at once
without losing an update. The layout they share (docs/key-schema.md, "Keep"):

- ``index`` (a sorted set): every chunk the policy holds, by its chunk key relative to the
  prefix, scored by the time (server ms) by which its class expects it read again;
- ``meta`` (a hash): for every chunk held or remembered, ``class,last_ms,seen,bytes,parts``;
- ``ghosts`` (a sorted set): the chunks remembered but not held (refused or evicted), by the
  time they became ghosts; at most ``ghost_max`` (the oldest forgotten, their meta too);
- ``figures`` (a hash): ``n:C`` accesses of class C, ``u:C`` of them followed by another,
  ``g:C:B`` gaps in bucket B (class -1: every class), ``h:C`` the horizons (ms) engines last
  computed from them, ``bytes`` the bytes of the chunks held, ``total`` accesses since the
  last halving.

Times are the server's (`TIME`), so engines' clocks never enter a score or a gap. The two
scripts that free memory (`EVICT`, `DROP`) run even on a server past `maxmemory`
(``allow-oom``): they are how it gets back under.
"""

from __future__ import annotations

from lmcache_remote.storage.keep.policy import BUCKETS_PER_OCTAVE, DECAY_AT

_PRELUDE = (
    "local t = redis.call('TIME') "
    "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) "
    "local function parse(m) "
    "  if not m then return nil end "
    "  local c, l, s, b, p = string.match(m, '^(%-?%d+),(%d+),(%d+),(%d+),(%d+)$') "
    "  if not c then return nil end "
    "  return {c, tonumber(l), tonumber(s), tonumber(b), tonumber(p)} "
    "end "
    "local function trim(ghost_max) "
    "  local over = redis.call('ZCARD', KEYS[3]) - ghost_max "
    "  if over > 0 then "
    "    local gone = redis.call('ZPOPMIN', KEYS[3], over) "
    "    for j = 1, #gone, 2 do "
    "      if not redis.call('ZSCORE', KEYS[1], gone[j]) then "
    "        redis.call('HDEL', KEYS[2], gone[j]) end "
    "    end "
    "  end "
    "end "
)

#: KEYS: index, meta, ghosts, figures. ARGV: ghost_max, then per access six fields: member,
#: class, mode, bytes, parts, parent (the member before it in its request, or "").
#: Modes: ``h`` a hit (rescored if held, else remembered), ``a`` a chunk that landed
#: (held from now on), ``A`` the same not counted as an access (a write outside a store's
#: plan), ``g`` a chunk refused (remembered). Each counted access adds to the figures: its
#: class's access, and, when the chunk was remembered, its previous class's reuse and gap.
#: Returns the bytes held.
ACCESS = _PRELUDE + (
    "local ghost_max = tonumber(ARGV[1]) "
    "local horizons = {} "
    "local function horizon(c) "
    "  local h = horizons[c] "
    "  if h == nil then "
    "    h = tonumber(redis.call('HGET', KEYS[4], 'h:' .. c) "
    "                 or redis.call('HGET', KEYS[4], 'h:-1') or '0') or 0 "
    "    horizons[c] = h "
    "  end "
    "  return h "
    "end "
    "local scores = {} "
    "local per_octave = " + str(BUCKETS_PER_OCTAVE) + " "
    "local total = 0 "
    "for i = 2, #ARGV, 6 do "
    "  local member, class, mode = ARGV[i], ARGV[i + 1], ARGV[i + 2] "
    "  local nbytes, parts, parent = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), ARGV[i + 5] "
    "  local old = parse(redis.call('HGET', KEYS[2], member)) "
    "  local seen = 0 "
    "  if old then "
    "    seen = old[3] "
    "    if nbytes == 0 then nbytes, parts = old[4], old[5] end "
    "  end "
    "  if mode ~= 'A' then "
    "    if old then "
    "      local gap = now - old[2] "
    "      if gap < 0 then gap = 0 end "
    "      local b = math.floor(math.log(gap + 1) / math.log(2) * per_octave) "
    "      redis.call('HINCRBY', KEYS[4], 'u:' .. old[1], 1) "
    "      redis.call('HINCRBY', KEYS[4], 'g:' .. old[1] .. ':' .. b, 1) "
    "      redis.call('HINCRBY', KEYS[4], 'g:-1:' .. b, 1) "
    "    end "
    "    redis.call('HINCRBY', KEYS[4], 'n:' .. class, 1) "
    "    total = redis.call('HINCRBY', KEYS[4], 'total', 1) "
    "  end "
    "  local s = now + horizon(class) "
    "  local cap = scores[parent] "
    "  if cap == nil and parent ~= '' then "
    "    cap = tonumber(redis.call('ZSCORE', KEYS[1], parent) or '') "
    "  end "
    "  if cap ~= nil and s >= cap then s = cap - 1 end "
    "  local held = redis.call('ZSCORE', KEYS[1], member) "
    "  if mode == 'a' or mode == 'A' then "
    "    if not held then "
    "      redis.call('HINCRBY', KEYS[4], 'bytes', nbytes) "
    "      redis.call('ZREM', KEYS[3], member) "
    "    end "
    "    redis.call('ZADD', KEYS[1], s, member) "
    "    scores[member] = s "
    "  elseif held then "
    "    if mode == 'h' then "
    "      redis.call('ZADD', KEYS[1], s, member) "
    "      scores[member] = s "
    "    end "
    "  else "
    "    redis.call('ZADD', KEYS[3], now, member) "
    "  end "
    "  redis.call('HSET', KEYS[2], member, "
    "    class .. ',' .. now .. ',' .. (seen + 1) .. ',' .. nbytes .. ',' .. parts) "
    "end "
    "trim(ghost_max) "
    "if total > " + str(DECAY_AT) + " then "
    "  local all = redis.call('HGETALL', KEYS[4]) "
    "  for j = 1, #all, 2 do "
    "    local f = all[j] "
    "    local kind = string.sub(f, 1, 2) "
    "    if kind == 'n:' or kind == 'u:' or kind == 'g:' or f == 'total' then "
    "      local v = math.floor(tonumber(all[j + 1]) / 2) "
    "      if v > 0 then redis.call('HSET', KEYS[4], f, v) "
    "      else redis.call('HDEL', KEYS[4], f) end "
    "    end "
    "  end "
    "end "
    "return redis.call('HGET', KEYS[4], 'bytes') or '0'"
)

#: KEYS: index, meta, ghosts, figures. ARGV: the bytes to get down to, the most chunks to
#: drop, ghost_max. Pops the lowest scores until the bytes held are at most the target; each
#: becomes a ghost. Returns member, parts, member, parts, ... of the chunks to drop.
EVICT = "#!lua flags=allow-oom\n" + _PRELUDE + (
    "local target, most = tonumber(ARGV[1]), tonumber(ARGV[2]) "
    "local bytes = tonumber(redis.call('HGET', KEYS[4], 'bytes') or '0') "
    "local out = {} "
    "while bytes > target and #out < 2 * most do "
    "  local low = redis.call('ZPOPMIN', KEYS[1]) "
    "  if #low == 0 then break end "
    "  local m = parse(redis.call('HGET', KEYS[2], low[1])) "
    "  local parts = 1 "
    "  if m then bytes = bytes - m[4]; parts = m[5] end "
    "  redis.call('ZADD', KEYS[3], now, low[1]) "
    "  out[#out + 1] = low[1] "
    "  out[#out + 1] = parts "
    "end "
    "if bytes < 0 or redis.call('ZCARD', KEYS[1]) == 0 then bytes = 0 end "
    "redis.call('HSET', KEYS[4], 'bytes', bytes) "
    "trim(tonumber(ARGV[3])) "
    "return out"
)

#: KEYS: every value key of one chunk (its slot). ARGV[1]: "1" when pins are expiries (a
#: pinned chunk's values have none: it stays). Drops the chunk whole; 1 when dropped, 0 kept.
DROP = (
    "#!lua flags=allow-oom\n"
    "if ARGV[1] == '1' and redis.call('PTTL', KEYS[1]) == -1 then return 0 end "
    "redis.call('UNLINK', unpack(KEYS)) "
    "return 1"
)
