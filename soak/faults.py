"""The soak's fault schedule: one fault every `interval` seconds, in a fixed rotation.

Each fault is a real server-side event on the soak's private redis-server, none a stub:

- `pause`: SIGSTOP, held for 2.5 x remote_timeout (every call in flight times out), SIGCONT;
- `client-kill`: `CLIENT KILL TYPE normal` (every engine connection cut at once);
- `corrupt`: flip one byte of up to 20 stored chunk values (`SETRANGE`, header or payload);
- `debug-sleep`: `DEBUG SLEEP 1.5 x remote_timeout` (the server hangs, then answers);
- `delete-parts`: `UNLINK` up to 20 part keys (`...}#1`), leaving their chunks incomplete;
- `squeeze`: `CONFIG SET maxmemory` to a quarter for 2 s (mass LRU eviction), then back;
- `kill-restart`: SIGKILL, then a restart on the same port (an empty server);
- `slow-link`: the engines' link crawls (their traffic goes through `tests/throttle.Throttle`;
  replies forwarded at 300 KiB/s) for 2.5 x remote_timeout, then runs free again: every call
  must still end by its deadline, what did not arrive is a miss;
- `next-release`: up to 20 stored chunks become a next release's values (their header's
  format version set to 2, the header checksum left as it was: this reader must not read
  further): misses, left in place, never served.

`FaultInjector` runs them from its own thread between `start()` and `stop()`; `events` lists
what was done when (seconds since the run's T0) and what it touched. A fault that cannot be
applied (the server is down after a kill that failed to restart) is recorded with its error;
the run then fails, since the soak can no longer say what it tested.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import redis

from lmcache_remote.admin.private_server import RedisServer
from lmcache_remote.naming.keys import PART_SEP, scan_pattern
from lmcache_remote.values.serde import MAGIC

ROTATION = ("pause", "client-kill", "corrupt", "slow-link", "debug-sleep", "delete-parts",
            "next-release", "squeeze", "kill-restart")
#: Bytes a second the engines' link forwards replies at during `slow-link`; otherwise free.
SLOW_RATE = 300 * 1024
FREE_RATE = float(1 << 40)
_SAMPLE = 20


class FaultInjector:
    """Applies `ROTATION` to `server`, one fault per `interval` from `start_at` (run seconds)."""

    def __init__(self, server: RedisServer, prefix: str, remote_timeout: float,
                 maxmemory: int, interval: float, seed: int, link: Any = None) -> None:
        """`link`: the engines' `Throttle` (its `rate` is what `slow-link` turns down)."""
        self.server = server
        self.link = link
        self.prefix = prefix
        self.remote_timeout = remote_timeout
        self.maxmemory = maxmemory
        self.interval = interval
        self.rng = random.Random(seed)
        self.events: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, t0: float, start_at: float, end_at: float) -> None:
        self._thread = threading.Thread(target=self._run, args=(t0, start_at, end_at),
                                        name="soak-faults", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 10 * self.remote_timeout + 30)

    def _client(self) -> redis.Redis:
        return self.server.client(socket_timeout=10 * self.remote_timeout + 10,
                                  socket_connect_timeout=5)

    def _run(self, t0: float, start_at: float, end_at: float) -> None:
        i = 0
        while True:
            at = t0 + start_at + i * self.interval
            if self._stop.wait(max(0.0, at - time.time())) or time.time() >= t0 + end_at:
                return
            name = ROTATION[i % len(ROTATION)]
            began = time.time()
            event: dict[str, Any] = {"fault": name, "at": round(began - t0, 2)}
            try:
                event.update(getattr(self, "_" + name.replace("-", "_"))())
            except Exception as exc:  # recorded: the run fails on it
                event["error"] = f"{type(exc).__name__}: {exc}"
            event["seconds"] = round(time.time() - began, 2)
            self.events.append(event)
            i += 1

    # -- the faults ----------------------------------------------------------------------

    def _pause(self) -> dict[str, Any]:
        held = 2.5 * self.remote_timeout
        self.server.pause()
        try:
            self._stop.wait(held)
        finally:
            self.server.resume()
        return {"held": held}

    def _client_kill(self) -> dict[str, Any]:
        client = self._client()
        try:
            return {"killed": int(client.execute_command("CLIENT", "KILL", "TYPE", "normal"))}
        finally:
            client.close()

    def _debug_sleep(self) -> dict[str, Any]:
        held = 1.5 * self.remote_timeout
        client = self._client()
        try:
            client.execute_command("DEBUG", "SLEEP", f"{held:g}")
        finally:
            client.close()
        return {"held": held}

    def _sample_keys(self, client: redis.Redis, parts_only: bool) -> list[bytes]:
        found: list[bytes] = []
        cursor = 0
        for _ in range(50):
            cursor, keys = client.scan(cursor=cursor, match=scan_pattern(self.prefix), count=500)
            names = [k if isinstance(k, bytes) else str(k).encode() for k in keys]
            found += [k for k in names if not parts_only or PART_SEP.encode() in k]
            if int(cursor) == 0 or len(found) >= 10 * _SAMPLE:
                break
        return self.rng.sample(found, min(_SAMPLE, len(found)))

    def _corrupt(self) -> dict[str, Any]:
        client = self._client()
        flipped = 0
        try:
            for key in self._sample_keys(client, parts_only=False):
                size = int(client.strlen(key))
                if size == 0:
                    continue
                offset = self.rng.randrange(size)
                reply = client.getrange(key, offset, offset)
                old = reply if isinstance(reply, bytes) else str(reply).encode("latin-1")
                if len(old) != 1:
                    continue
                client.setrange(key, offset, bytes([old[0] ^ (1 << self.rng.randrange(8))]))
                flipped += 1
        finally:
            client.close()
        return {"values": flipped}

    def _delete_parts(self) -> dict[str, Any]:
        client = self._client()
        try:
            keys = self._sample_keys(client, parts_only=True)
            return {"parts": int(client.unlink(*keys)) if keys else 0}
        finally:
            client.close()

    def _squeeze(self) -> dict[str, Any]:
        client = self._client()
        low = max(4 << 20, self.maxmemory // 4)
        try:
            client.config_set("maxmemory", low)
            self._stop.wait(2.0)
        finally:
            client.config_set("maxmemory", self.maxmemory)
            client.close()
        return {"low": low}

    def _slow_link(self) -> dict[str, Any]:
        held = 2.5 * self.remote_timeout
        if self.link is None:
            raise RuntimeError("slow-link needs the engines' traffic through a Throttle")
        self.link.rate = SLOW_RATE
        try:
            self._stop.wait(held)
        finally:
            self.link.rate = FREE_RATE
        return {"held": held, "rate": SLOW_RATE}

    def _next_release(self) -> dict[str, Any]:
        client = self._client()
        marked = 0
        try:
            for key in self._sample_keys(client, parts_only=False):
                if PART_SEP.encode() in key:
                    continue  # value 0 holds the header
                head = client.getrange(key, 0, 4)
                if isinstance(head, bytes) and head[:4] == MAGIC and len(head) == 5:
                    client.setrange(key, 4, b"\x02")  # format version 2
                    marked += 1
        finally:
            client.close()
        return {"values": marked}

    def _kill_restart(self) -> dict[str, Any]:
        self.server.kill()
        self._stop.wait(1.0)
        self.server.start()
        return {"pid": self.server.pid}
