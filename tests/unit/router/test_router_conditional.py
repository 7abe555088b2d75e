"""Conditional disaggregation in the router: which path a request takes, and why."""

from __future__ import annotations

import threading
import time

import pytest

from baton.config import BatonConfig
from baton.config.router import RouterConfig
from baton.contract import (
    DecodeChunk,
    FinishReason,
    Reservation,
    Role,
    ServeInput,
    WorkerInfo,
    WorkerLoad,
    WorkerView,
    wire,
)
from baton.errors import ConfigError
from baton.sampling import SamplingParams
from router.conditional import decide
from router.locality import SnapshotLocator
from router.orchestrator import Orchestrator
from router.policies import make_policy
from router.registry import Registry

TPB = 16


def view(wid: str, running: int = 0) -> WorkerView:
    return WorkerView(wid, Role.DECODE, f"{wid}:1", TPB, WorkerLoad(running=running), 0)


CFG = RouterConfig(local_prefill_max_tokens=100, prefix_load_slack=2)


def test_the_deepest_decode_holder_serves_a_short_increment_alone():
    d1, d2 = view("d1"), view("d2")
    assert decide(300, {"d1": 250, "d2": 150}, [d1, d2], d2, CFG) == (d1, "decode_snapshot")
    # equal depth: the policy's pick, then the least loaded
    assert decide(300, {"d1": 250, "d2": 250}, [d1, d2], d2, CFG) == (d2, "decode_snapshot")


def test_reasons_for_going_through_a_prefill_worker():
    d1, d2 = view("d1"), view("d2", running=5)
    assert decide(300, {}, [d1, d2], d1, CFG) == (None, "no_decode_snapshot")
    assert decide(300, {"d1": 199}, [d1, d2], d1, CFG) == (None, "increment_too_large")
    assert decide(300, {"d1": 200}, [d1, d2], d1, CFG)[0] == d1  # exactly the limit: local
    # the only holder is past the load slack (5 > 0 + 2)
    assert decide(300, {"d2": 290}, [d1, d2], d1, CFG) == (None, "decode_busy")
    off = RouterConfig(local_prefill_max_tokens=0)
    assert decide(300, {"d1": 290}, [d1], d1, off) == (None, "disabled")


def test_the_limit_is_validated_by_name():
    with pytest.raises(ConfigError, match="router.local_prefill_max_tokens"):
        BatonConfig.from_dict({"router": {"local_prefill_max_tokens": -1}})
    assert RouterConfig().local_prefill_max_tokens == 512


@pytest.mark.parametrize("policy", ["session", "prefix_aware"])
def test_a_decode_end_hint_is_found_before_any_heartbeat(policy):
    cfg = RouterConfig(policy=policy)
    locator = SnapshotLocator(cfg, make_policy(cfg))
    d1, d2 = view("d1"), view("d2")
    history = list(range(3, 3 + 70))  # prompt + answer of a finished turn
    locator.hint(d1, history, 70)
    locator.hint(d2, history, 0)  # no snapshot taken: nothing indexed
    next_turn = history + [9, 9, 9]
    assert locator.matched_tokens(next_turn, [d1, d2]) == {"d1": 70}
    locator.forget("d1") if locator.listens else locator._policy.forget("d1")
    assert locator.matched_tokens(next_turn, [d1, d2]) == {}


def test_serve_and_its_chunks_cross_the_wire_unchanged():
    inp = ServeInput("r1", (5, 6, 7), SamplingParams(max_tokens=4), "chat", 512)
    assert wire.serve_from_pb(wire.serve_to_pb(inp)) == inp
    chunk = DecodeChunk((8, 9), FinishReason.LENGTH, cached_tokens=3, snapshot_tokens=11)
    assert wire.decode_chunk_from_pb(wire.decode_chunk_to_pb(chunk)) == chunk


class _Client:
    """A worker as the shipper calls it; `gate` holds PullSnapshot until set."""

    def __init__(self, wid, log, gate):
        self.wid, self.log, self.gate = wid, log, gate

    def hold_snapshot(self, req, cancel):
        self.log.append(("hold", self.wid, len(req.prompt_ids)))
        return Reservation(self.wid, "tcp://x", (1, 2), 3)

    def pull_snapshot(self, shipment, cancel):
        self.gate.wait(5)
        self.log.append(("pull", self.wid, shipment.source.worker_id))
        return 1

    def abort(self, rid):
        self.log.append(("abort", self.wid))
        return self.released.pop(0) if getattr(self, "released", None) else True


def test_the_decode_end_state_is_shipped_to_the_prefill_worker_of_the_turn():
    cfg = RouterConfig(policy="prefix_aware")
    reg = Registry(cfg.eject_after_seconds)
    for wid, role in (("p1", Role.PREFILL), ("p2", Role.PREFILL), ("d1", Role.DECODE)):
        reg.register(WorkerInfo(wid, role, f"h:{wid}"))
    log, gate = [], threading.Event()
    clients = {w: _Client(w, log, gate) for w in ("p1", "p2", "d1")}
    orch = Orchestrator(cfg, reg, make_policy(cfg), lambda v: clients[v.worker_id])
    views = {v.worker_id: v for v in reg.workers()}
    history = tuple(range(3, 43))
    orch.turn_ended(views["d1"], history, 40, views["p2"])
    waiter = threading.Thread(target=orch.shipper.wait_for, args=(views["p2"], history + (7,)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()  # the next turn waits for the shipment heading to its worker
    gate.set()
    waiter.join(5)
    assert not waiter.is_alive()
    assert log == [("hold", "d1", 40), ("pull", "p2", "d1"), ("abort", "d1")]
    assert orch.locator.matched_tokens(history + (7,), [views["p2"]]) == {"p2": 40}
    log.clear()
    orch.turn_ended(views["d1"], history, 40)  # p2 holds it now: nothing to ship
    time.sleep(0.1)
    assert log == []


@pytest.mark.parametrize("answers, asked", [([False, True], 2), ([False] * 5, 3)])
def test_a_hold_release_that_found_nothing_is_asked_again(answers, asked):
    """The decode worker's Abort of a shipment's hold answered False (too busy to answer within
    router.abort_timeout_seconds, or already released): asked again, at most RELEASE_ATTEMPTS
    times, so a slow worker does not keep the snapshot's slot and blocks until the lease ends."""
    from router.shipping import RELEASE_ATTEMPTS

    cfg = RouterConfig(policy="prefix_aware")
    reg = Registry(cfg.eject_after_seconds)
    for wid, role in (("p1", Role.PREFILL), ("d1", Role.DECODE)):
        reg.register(WorkerInfo(wid, role, f"h:{wid}"))
    log, gate = [], threading.Event()
    gate.set()
    clients = {w: _Client(w, log, gate) for w in ("p1", "d1")}
    clients["d1"].released = list(answers)
    orch = Orchestrator(cfg, reg, make_policy(cfg), lambda v: clients[v.worker_id])
    views = {v.worker_id: v for v in reg.workers()}
    orch.turn_ended(views["d1"], tuple(range(3, 43)), 40, views["p1"])
    deadline = time.monotonic() + 5
    while orch.shipper.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert RELEASE_ATTEMPTS == 3
    assert log == [("hold", "d1", 40), ("pull", "p1", "d1")] + [("abort", "d1")] * asked
