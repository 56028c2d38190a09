"""Part sizes that fit Redis's allocator: how a chunk is cut so that its values waste little.

Redis keeps each string value in one allocation from jemalloc, which rounds every size up to a
size class: four classes per doubling (for 4 MiB < n <= 8 MiB they are 5, 6, 7 and 8 MiB).
A value just over a class costs the next one: a 64 KiB chunk plus its 100-byte header takes an
80 KiB allocation (1.25x), a 3 MiB chunk (a 0.5B-parameter model's 256 tokens) 3.5 MiB
(1.17x), a part of exactly 512 KiB 640 KiB. `plan_part_size` picks, per chunk size, the part
size whose values add up to the fewest allocated bytes, counting a fixed cost per extra value
(its key and bookkeeping in Redis), among a handful of candidates: the configured part size,
near-equal splits, and splits whose full parts just fill a class (the rest spilling into one
small last part).

Every engine computes the same plan from the chunk's size and the configured part size (no
round trip needed to know a chunk's keys); a value written with another plan still reads,
because the header records the part size (at the cost of one more round trip to fetch the
parts the header lists). Sizes are planned for the largest stored size any codec may produce
(`max_encoded_nbytes`), so a compressed part never crosses the class either: raw values land
about 0.4% under their class.
"""

from __future__ import annotations

import functools

from lmcache_remote.values.codecs import CODECS
from lmcache_remote.values.value_format import header_nbytes

#: Bytes Redis adds to a value's own allocation: the sds header (9 bytes above 64 KiB), the
#: terminating NUL, and the CRLF room of the query buffer it was received in; rounded up.
ALLOC_OVERHEAD = 16
#: What one more value costs besides its bytes: its key (an sds of ~100 bytes for ours), the
#: dict entry and the value object. An estimate, used to weigh a split against what it saves.
VALUE_OVERHEAD = 192


def size_class(nbytes: int) -> int:
    """The size jemalloc rounds an allocation of ``nbytes`` up to (Redis's default allocator)."""
    if nbytes <= 8:
        return 8
    if nbytes <= 128:
        return -(-nbytes // 16) * 16
    spacing = 1 << ((nbytes - 1).bit_length() - 3)  # a quarter of the power of two below
    return -(-nbytes // spacing) * spacing


def _class_below(size: int) -> int:
    """The largest size class under ``size`` (itself a class)."""
    if size <= 128:
        return max(8, size - 16)
    return size - (1 << ((size - 1).bit_length() - 3))


def value_cost(nbytes: int) -> int:
    """Bytes Redis allocates for a string value of ``nbytes`` bytes (the value alone)."""
    return size_class(nbytes + ALLOC_OVERHEAD)


def stored_bound(raw_nbytes: int) -> int:
    """The largest stored size of a part of ``raw_nbytes`` raw bytes, over every codec."""
    return max(codec.max_encoded_nbytes(raw_nbytes) for codec in CODECS.values())


def _header(part_count: int) -> int:
    return header_nbytes(part_count)


def plan_cost(raw_nbytes: int, part_size: int) -> int:
    """Bytes Redis allocates for a chunk of ``raw_nbytes`` cut into ``part_size`` parts (each
    part at its largest stored size), plus `VALUE_OVERHEAD` per value."""
    count = max(1, -(-raw_nbytes // part_size))
    last = raw_nbytes - (count - 1) * part_size
    head = _header(count)
    if count == 1:
        return VALUE_OVERHEAD + value_cost(head + stored_bound(last))
    full = stored_bound(part_size)
    return (count * VALUE_OVERHEAD + value_cost(head + full) + (count - 2) * value_cost(full)
            + value_cost(stored_bound(last)))


def _filling(limit: int, count: int, max_part: int) -> int:
    """The largest part size (at most ``max_part``) whose value 0 of a ``count``-part chunk
    still fits an allocation of ``limit`` bytes; 0 if none does."""
    low, high = 0, max_part  # fits(low) holds (0 stands for "none"), fits(size) is monotonic
    while low < high:
        mid = (low + high + 1) // 2
        if value_cost(_header(count) + stored_bound(mid)) <= limit:
            low = mid
        else:
            high = mid - 1
    return low


#: Every planned part size of a multi-part chunk is a multiple of this: a part boundary never
#: splits an element (`lz4-planes` splits a part's elements into byte planes) and parts start
#: on cache lines.
ALIGN = 64

#: `plan_part_size` adds at most this many parts to the ``ceil(raw / max_part)`` of a uniform
#: cut (near-equal splits into up to two more, a filled class one more still).
EXTRA_PARTS = 3


def max_part_count(raw_nbytes: int, max_part: int) -> int:
    """At least as many parts as a plan cuts any chunk of up to ``raw_nbytes`` bytes into."""
    return max(1, -(-raw_nbytes // max_part)) + EXTRA_PARTS


@functools.lru_cache(maxsize=4096)
def plan_part_size(raw_nbytes: int, max_part: int) -> int:
    """The part size (at most ``max_part``) that stores a chunk of ``raw_nbytes`` raw bytes in
    the fewest allocated bytes (`plan_cost`); among equals, the largest (fewest values). A
    multi-part cut uses a multiple of `ALIGN` (``max_part`` rounded down to one, at least)."""
    if raw_nbytes <= 0:
        return max_part
    if raw_nbytes <= max_part:  # one part: its size is the chunk's, whatever its alignment
        candidates = {raw_nbytes}
    max_part -= max_part % ALIGN
    first = max(1, -(-raw_nbytes // max_part))
    if raw_nbytes > max_part:
        candidates = {max_part}
    for count in range(first, first + 3):
        even = -(-raw_nbytes // count)
        even += -even % ALIGN
        if even > max_part:
            continue
        if -(-raw_nbytes // even) >= 2:
            candidates.add(even)
        held = value_cost(_header(count) + stored_bound(even))
        below = _class_below(held)  # the class just under the one `even` lands in
        for limit in (held, below):
            for parts in (count, count + 1):  # filling a class may need one more value
                size = _filling(limit, parts, max_part)
                size -= size % ALIGN
                if size > 0 and -(-raw_nbytes // size) == parts >= 2:
                    candidates.add(size)
    return min(candidates, key=lambda size: (plan_cost(raw_nbytes, size), -size))


def longest_value(raw_nbytes: int) -> int:
    """The longest value a chunk of up to ``raw_nbytes`` raw bytes can have, whoever cut it
    (parts of at least 4 KiB): the whole chunk in one value, a compressing codec's worst-case
    growth, the header of the most parts. A read refuses a longer reply before allocating
    anything for it."""
    return 2 * raw_nbytes + _header(-(-raw_nbytes // 4096)) + (64 << 10)
