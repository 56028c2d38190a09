"""The health gate and the remote call policy under failures a real server cannot time on cue:
many threads failing at once, an error answer, a reply the client cannot handle.

The gate's back-off runs on a clock the tests advance by hand (`Clock`), so "one back-off
later" is exact, whatever the load on the machine."""

from __future__ import annotations

import threading

import pytest
import redis
from faultkit import Clock

from lmcache_remote import BackendError
from lmcache_remote.storage.session.client import RemoteCaller
from lmcache_remote.storage.session.health import HealthGate


def test_failures_of_calls_already_in_flight_do_not_stretch_the_backoff() -> None:
    clock = Clock()
    gate = HealthGate(0.2, clock=clock)
    admitted = [gate.allow() for _ in range(8)]  # eight threads' calls, all let through
    assert all(admitted)
    for _ in admitted:  # ... and all fail against the same dead server
        gate.failure()
    assert gate.healthy is False and gate.allow() is False
    clock.advance(0.19)
    assert gate.allow() is False
    clock.advance(0.02)
    assert gate.allow() is True  # one back-off later a probe goes through, not 25 s later
    gate.success()
    assert gate.healthy is True


def test_a_failed_probe_still_doubles_the_backoff() -> None:
    clock = Clock()
    gate = HealthGate(0.1, clock=clock)
    assert gate.allow()
    gate.failure()
    clock.advance(0.11)
    assert gate.allow() is True  # the probe
    gate.failure()
    clock.advance(0.11)
    assert gate.allow() is False  # 0.2 s now
    clock.advance(0.1)
    assert gate.allow() is True


def test_an_error_answer_keeps_the_gate_open() -> None:
    caller = RemoteCaller(1.0, HealthGate(30.0))

    def oom() -> None:
        raise redis.exceptions.OutOfMemoryError(
            "OOM command not allowed when used memory > 'maxmemory'.")

    with pytest.raises(BackendError):
        caller.call(oom)
    assert caller.gate.healthy is True
    assert caller.call(lambda: 7) == 7  # not skipped


def test_an_unexpected_exception_becomes_a_backend_error_and_ends_the_probe() -> None:
    clock = Clock()
    caller = RemoteCaller(1.0, HealthGate(0.05, clock=clock))

    def broken() -> None:
        raise ValueError("sink returned buffers that do not add up to the reply length")

    with pytest.raises(BackendError, match="unexpected ValueError"):
        caller.call(broken)
    with pytest.raises(BackendError, match="skipped"):
        caller.call(broken)  # backing off: not even called
    clock.advance(0.06)
    with pytest.raises(BackendError, match="unexpected ValueError"):  # the probe fails the
        caller.call(broken)                                           # same way ...
    clock.advance(0.11)
    assert caller.call(lambda: 1) == 1  # ... and yet the gate lets the next probe through


def test_concurrent_callers_of_a_dead_server_recover_after_one_backoff() -> None:
    clock = Clock()
    caller = RemoteCaller(1.0, HealthGate(0.2, clock=clock))
    start = threading.Barrier(6)

    def dead() -> None:
        start.wait()
        raise redis.ConnectionError("Connection refused")

    errors: list[BaseException] = []

    def run() -> None:
        try:
            caller.call(dead)
        except BackendError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 6
    with pytest.raises(BackendError, match="skipped"):
        caller.call(lambda: "too early")
    clock.advance(0.21)  # one back-off, not six doublings of it
    assert caller.call(lambda: "back") == "back"
