"""Registry: registration, heartbeats, ejection of silent workers, listener notifications."""

from __future__ import annotations

import pytest

from baton.contract import Role, SnapshotEvent, WorkerInfo, WorkerLoad
from router.registry import Registry


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Listener:
    def __init__(self):
        self.events, self.forgotten = [], []

    def observe(self, worker_id, events):
        self.events.append((worker_id, list(events)))

    def forget(self, worker_id):
        self.forgotten.append(worker_id)


def make(eject=5.0):
    clock, listener = Clock(), Listener()
    return Registry(eject, [listener], clock), clock, listener


def info(wid, role=Role.PREFILL):
    return WorkerInfo(wid, role, f"host:{wid}")


def test_workers_are_listed_by_role_in_id_order():
    reg, _, _ = make()
    for wid, role in (("p1", Role.PREFILL), ("d0", Role.DECODE), ("p0", Role.PREFILL)):
        reg.register(info(wid, role))
    assert [w.worker_id for w in reg.workers(Role.PREFILL)] == ["p0", "p1"]
    assert [w.worker_id for w in reg.workers()] == ["d0", "p0", "p1"]


def test_silent_worker_is_ejected_after_eject_after_seconds_only():
    reg, clock, listener = make(eject=5.0)
    reg.register(info("p0"))
    reg.register(info("p1"))
    clock.now += 3.0
    assert reg.heartbeat("p1", WorkerLoad(running=2), [])
    clock.now += 2.0  # p0 silent exactly 5.0 s: still in
    assert [w.worker_id for w in reg.workers()] == ["p0", "p1"]
    clock.now += 0.5
    assert [w.worker_id for w in reg.workers()] == ["p1"]
    assert listener.forgotten == ["p0"]
    assert reg.workers()[0].load.running == 2
    assert reg.workers()[0].seconds_since_heartbeat == pytest.approx(2.5)


def test_heartbeat_from_unknown_worker_asks_to_register_again():
    reg, clock, _ = make(eject=1.0)
    reg.register(info("p0"))
    clock.now += 2.0
    assert reg.eject_stale() == ["p0"]
    assert reg.heartbeat("p0", WorkerLoad(), []) is False
    reg.register(info("p0"))
    assert reg.heartbeat("p0", WorkerLoad(), []) is True


def test_events_reach_listeners_and_reregistration_forgets_old_state():
    reg, _, listener = make()
    removed = []
    reg.on_remove.append(removed.append)
    reg.register(info("p0"))
    event = SnapshotEvent(True, 1, 2, 16)
    reg.heartbeat("p0", WorkerLoad(), [event])
    assert listener.events == [("p0", [event])]
    reg.register(info("p0"))
    assert listener.forgotten == ["p0"] and removed == ["p0"]
    assert reg.deregister("p0") and not reg.deregister("p0")


def test_inflight_counts_routed_requests():
    reg, _, _ = make()
    reg.register(info("p0"))
    reg.begin("p0")
    reg.begin("p0")
    reg.end("p0")
    assert reg.get("p0").inflight == 1
    reg.end("p0")
    reg.end("p0")
    assert reg.get("p0").inflight == 0


def test_register_requires_id_and_address():
    reg, _, _ = make()
    with pytest.raises(ValueError, match="worker_id and address are required"):
        reg.register(WorkerInfo("", Role.DECODE, "h:1"))


def test_only_ejection_for_silence_calls_on_eject_before_on_remove():
    reg, clock, _ = make()
    calls = []
    reg.on_eject.append(lambda w: calls.append(("eject", w)))
    reg.on_remove.append(lambda w: calls.append(("remove", w)))
    for w in ("p0", "d0", "d1"):
        reg.register(info(w, Role.DECODE if w.startswith("d") else Role.PREFILL))
    reg.register(info("p0"))  # a re-registration is no ejection
    assert reg.deregister("d1")  # nor is leaving
    clock.now += 6.0
    reg.heartbeat("d0", WorkerLoad(), [])
    assert reg.eject_stale() == ["p0"]
    assert calls == [("remove", "p0"), ("remove", "d1"), ("eject", "p0"), ("remove", "p0")]
