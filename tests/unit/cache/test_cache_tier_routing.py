"""prefix_aware counts disk-tier hits: the deepest match wins, a pool hit beats a tier hit of
the same depth, a tier hit beats nothing; workers report their disk entries as tier 1."""

from __future__ import annotations

import dataclasses

from baton.cache.manager import HybridCacheManager
from baton.config.router import RouterConfig
from baton.contract import Role, SnapshotEvent
from baton.contract.prefix_hash import snapshot_key
from baton.contract.wire import event_from_pb, event_to_pb
from baton.worker.snapshots import SnapshotEvents
from router.policies import RouteRequest, make_policy
from tests.unit.cache.test_cache_tiers import A, B, C, compute, make
from tests.unit.router.test_router_prefix import PROMPT, ins, view


def tier(tokens, n):
    return dataclasses.replace(ins(tokens, n), tier=1)


def choose(events: dict[str, list[SnapshotEvent]]) -> str:
    policy = make_policy(RouterConfig(policy="prefix_aware"))
    for w, evs in events.items():
        policy.observe(w, evs)
    pre = [view(w) for w in sorted(events)]
    return policy.choose(RouteRequest("r", PROMPT), pre, [view("d", Role.DECODE)]).prefill.worker_id


def test_pool_hit_beats_tier_hit_of_same_depth():
    assert choose({"a": [tier(PROMPT, 32)], "b": [ins(PROMPT, 32)]}) == "b"
    assert choose({"a": [ins(PROMPT, 32)], "b": [tier(PROMPT, 32)]}) == "a"


def test_tier_hit_beats_nothing_and_a_shallower_pool_hit():
    assert choose({"a": [], "b": [tier(PROMPT, 32)]}) == "b"
    assert choose({"a": [ins(PROMPT, 16)], "b": [tier(PROMPT, 48)]}) == "b"


def test_pool_eviction_keeps_the_tier_record():
    evicted = dataclasses.replace(ins(PROMPT, 32), inserted=False)
    assert choose({"a": [ins(PROMPT, 32), tier(PROMPT, 32), evicted], "b": []}) == "a"


def test_tier_rides_the_wire():
    ev = tier(PROMPT, 48)
    assert event_from_pb(event_to_pb(ev)) == ev


def test_worker_reports_disk_entries_as_tier_one(tmp_path):
    m: HybridCacheManager = make(tmp_path)
    events = SnapshotEvents(m)
    for rid, p, s in (("a", A, 10.0), ("b", B, 20.0), ("c", C, 30.0)):
        compute(m, rid, p, s)
    k = snapshot_key(A, 9, 4)
    got = events.drain(full=False)
    assert SnapshotEvent(False, k.block_hash, k.snapshot_hash, 9, 0) in got
    assert SnapshotEvent(True, k.block_hash, k.snapshot_hash, 9, 1) in got
    restarted = SnapshotEvents(make(tmp_path))  # a new worker reports what it found
    assert restarted.drain(full=True) == [SnapshotEvent(True, k.block_hash, k.snapshot_hash, 9, 1)]
