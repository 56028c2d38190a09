"""`SimCache`: what every simulated cache policy implements (`replay.offline` and
`replay.published` alike), the prefix cache's two moves."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SimCache"]


class SimCache:
    """The interface a simulated policy implements: `lookup` the leading hits (and note them
    as used), then `store` the request's blocks it lacks. ``now`` is the request's index."""

    def lookup(self, blocks: Sequence[int], now: int) -> int:
        raise NotImplementedError

    def store(self, blocks: Sequence[int], now: int) -> int:
        """Stores what it admits of ``blocks``; how many blocks it wrote."""
        raise NotImplementedError
