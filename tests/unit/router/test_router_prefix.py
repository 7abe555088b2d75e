"""Snapshot keys, the bounded prefix index, and prefix_aware's snapshot-only hits."""

from __future__ import annotations

import hashlib
import struct

import pytest

from baton.config.router import RouterConfig
from baton.contract import Role, SnapshotEvent, WorkerLoad, WorkerView
from baton.contract.prefix_hash import ROOT_HASH, block_hashes, snapshot_key
from router.policies import RouteRequest, make_policy
from router.prefix_index import PrefixIndex

TPB = 16
PROMPT = tuple(range(100, 164))  # 64 tokens, 4 blocks


def ins(tokens, n, tpb=TPB):
    k = snapshot_key(tokens, n, tpb)
    return SnapshotEvent(True, k.block_hash, k.snapshot_hash, n)


def ev(tokens, n, tpb=TPB):
    k = snapshot_key(tokens, n, tpb)
    return SnapshotEvent(False, k.block_hash, k.snapshot_hash, n)


def b8(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def test_hash_definition_matches_the_documented_formula():
    toks = list(range(1, 21))
    h1 = b8((0).to_bytes(8, "little") + struct.pack("<16i", *toks[:16]))
    assert block_hashes(toks, 16) == [ROOT_HASH, h1]
    tail = b8(
        b"S"
        + h1.to_bytes(8, "little")
        + (20).to_bytes(8, "little")
        + struct.pack("<4i", *toks[16:])
    )
    assert snapshot_key(toks, 20, 16) == (h1, tail, 20)
    aligned = b8(b"S" + h1.to_bytes(8, "little") + (16).to_bytes(8, "little"))
    assert snapshot_key(toks, 16, 16) == (h1, aligned, 16)
    assert snapshot_key(toks, 3, 16).block_hash == ROOT_HASH


def test_keys_depend_on_every_token_and_on_block_size():
    other = PROMPT[:5] + (7,) + PROMPT[6:]
    assert snapshot_key(PROMPT, 48, TPB) != snapshot_key(other, 48, TPB)
    assert snapshot_key(PROMPT, 48, TPB).block_hash != snapshot_key(PROMPT, 48, 8).block_hash
    with pytest.raises(ValueError, match=r"num_tokens must be in \[1, 64\], got 65"):
        snapshot_key(PROMPT, 65, TPB)


def test_match_needs_a_snapshot_and_never_covers_the_last_token():
    idx = PrefixIndex(100)
    idx.apply("w", [ins(PROMPT, 16), ins(PROMPT, 32), ins(PROMPT, 48)])
    shares_40 = PROMPT[:40] + (1,) * 24
    assert idx.match(shares_40, TPB) == {"w": 32}
    assert idx.match(PROMPT[:48], TPB) == {"w": 32}  # exact repeat: last token recomputed
    assert idx.match(PROMPT[:49], TPB) == {"w": 48}
    assert idx.match((5,) + PROMPT[1:], TPB) == {}


def test_unaligned_snapshot_is_verified_by_its_tail_tokens():
    idx = PrefixIndex(100)
    idx.apply("w", [ins(PROMPT, 40)])
    assert idx.match(PROMPT[:40] + (0, 0), TPB) == {"w": 40}
    diverges_at_38 = PROMPT[:38] + (0,) * 10
    assert idx.match(diverges_at_38, TPB) == {}


def test_evicted_snapshot_no_longer_counts_but_a_shallower_one_does():
    idx = PrefixIndex(100)
    idx.apply("w", [ins(PROMPT, 16), ins(PROMPT, 48)])
    idx.apply("w", [ev(PROMPT, 48)])
    assert idx.match(PROMPT, TPB) == {"w": 16}
    idx.apply("w", [ev(PROMPT, 16), ev(PROMPT, 16)])
    assert idx.match(PROMPT, TPB) == {}
    assert len(idx) == 0 and idx.num_nodes == 0
    idx.check_integrity()


def test_index_stays_bounded_and_evicts_least_recently_used():
    idx = PrefixIndex(max_entries=50)
    prompts = [tuple(range(i * 1000, i * 1000 + 40)) for i in range(200)]
    for i, p in enumerate(prompts):
        idx.apply(f"w{i % 3}", [ins(p, 32)])
        if i >= 1:
            idx.match(prompts[0], TPB)  # keeps prompt 0 recently used
    assert len(idx) == 50
    idx.check_integrity()
    assert idx.match(prompts[0], TPB) == {"w0": 32}
    assert idx.match(prompts[1], TPB) == {}
    assert idx.match(prompts[-1], TPB) == {"w1": 32}


def test_remove_worker_drops_only_its_snapshots():
    idx = PrefixIndex(100)
    idx.apply("a", [ins(PROMPT, 32)])
    idx.apply("b", [ins(PROMPT, 32), ins(PROMPT, 16)])
    idx.remove_worker("b")
    assert idx.match(PROMPT, TPB) == {"a": 32}
    assert (idx.tracked("a"), idx.tracked("b")) == (1, 0)
    idx.check_integrity()


def view(wid, role=Role.PREFILL, running=0, tpb=TPB):
    return WorkerView(wid, role, f"{wid}:1", tpb, WorkerLoad(running=running), 0)


def test_prefix_aware_prefers_the_deepest_snapshot_not_the_longest_kv():
    policy = make_policy(RouterConfig(policy="prefix_aware"))
    policy.observe("p0", [ins(PROMPT, 16)])
    policy.observe("p1", [ins(PROMPT, 48)])
    policy.observe("d1", [ins(PROMPT, 32)])
    pre = [view("p0"), view("p1", running=2)]
    dec = [view("d0", Role.DECODE), view("d1", Role.DECODE)]
    choice = policy.choose(RouteRequest("r", PROMPT), pre, dec)
    assert (choice.prefill.worker_id, choice.decode.worker_id) == ("p1", "d1")
    diverges_at_20 = PROMPT[:20] + (0,) * 30
    choice = policy.choose(RouteRequest("r", diverges_at_20), pre, dec)
    assert choice.prefill.worker_id == "p0"


def test_prefix_aware_without_hits_or_with_equal_hits_picks_least_loaded():
    policy = make_policy(RouterConfig(policy="prefix_aware"))
    pre = [view("p0", running=3), view("p1", running=1)]
    dec = [view("d0", Role.DECODE)]
    assert policy.choose(RouteRequest("r", PROMPT), pre, dec).prefill.worker_id == "p1"
    policy.observe("p0", [ins(PROMPT, 32)])
    policy.observe("p1", [ins(PROMPT, 32)])
    assert policy.choose(RouteRequest("r", PROMPT), pre, dec).prefill.worker_id == "p1"


def test_prefix_aware_load_slack_beats_a_hot_prefix():
    policy = make_policy(RouterConfig(policy="prefix_aware", prefix_load_slack=2))
    policy.observe("p0", [ins(PROMPT, 48)])
    dec = [view("d0", Role.DECODE)]
    within = [view("p0", running=2), view("p1")]
    assert policy.choose(RouteRequest("r", PROMPT), within, dec).prefill.worker_id == "p0"
    beyond = [view("p0", running=3), view("p1")]
    assert policy.choose(RouteRequest("r", PROMPT), beyond, dec).prefill.worker_id == "p1"


def test_prefix_aware_forgets_departed_workers_and_honours_each_block_size():
    policy = make_policy(RouterConfig(policy="prefix_aware", prefix_tree_max_nodes=10))
    policy.observe("p8", [ins(PROMPT, 40, tpb=8)])
    pre = [view("p0"), view("p8", running=1, tpb=8)]
    dec = [view("d0", Role.DECODE)]
    assert policy.choose(RouteRequest("r", PROMPT), pre, dec).prefill.worker_id == "p8"
    assert policy.tracked_snapshots("p8") == 1
    policy.forget("p8")
    assert policy.choose(RouteRequest("r", PROMPT), pre, dec).prefill.worker_id == "p0"
