"""HealthGate: after a remote failure, skip the remote tier for a back-off instead of waiting.

A failed remote call opens the gate's back-off (`unhealthy_backoff` seconds, doubling on each
further failure up to `max_backoff`). While it is open, `allow()` answers False at once, so a
dead or hung Redis costs inference nothing but a clock read. When the back-off ends, one call
is let through as a probe; its success closes the gate, its failure re-opens it, longer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class HealthGate:
    """Thread-safe circuit breaker with exponential back-off and a single probe."""

    def __init__(self, backoff: float, max_backoff: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: seconds, never going back (tests pass one they advance by hand)."""
        self._clock = clock
        self._base = backoff
        self._max = max(max_backoff, backoff)
        self._lock = threading.Lock()
        self._failures = 0
        self._until = 0.0
        self._probing = False
        self.closed = False

    @property
    def healthy(self) -> bool:
        return self._failures == 0

    def close(self) -> None:
        """No remote call is allowed any more (the tier is closing)."""
        with self._lock:
            self.closed = True

    def allow(self) -> bool:
        """Whether a remote call may be made now (False while backing off or probing, and for
        ever once closed)."""
        with self._lock:
            if self.closed:
                return False
            if self._failures == 0:
                return True
            if self._probing or self._clock() < self._until:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._probing = False

    def failure(self) -> None:
        """A call failed. Only the failure that opens the gate, or a failed probe, lengthens
        the back-off: calls that were already in flight when the first one failed (several
        threads hitting the same dead server) must not double it once each, or a short outage
        would keep the tier skipped for `max_backoff`."""
        with self._lock:
            if self._failures and not self._probing and self._clock() < self._until:
                return
            self._failures += 1
            self._probing = False
            delay = min(self._max, self._base * 2 ** min(self._failures - 1, 16))
            self._until = self._clock() + delay

    def reset(self) -> None:
        """Forget past failures (used after an explicit reconnect)."""
        self.success()
