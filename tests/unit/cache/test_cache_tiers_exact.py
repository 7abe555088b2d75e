"""Tiers keep reuse exact: with a pool far smaller than the working set and the disk tier on,
interleaved multi-turn chats give the tokens of reuse off, the tier serves hits, and damaged
entries or a restart change nothing but the hit counts."""

from __future__ import annotations

import os
import socket
import subprocess

import pytest

from baton.engine.request import Request
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

SESSIONS, TURNS = 4, 4


@pytest.fixture(scope="module", params=["tiny", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers")
    if request.param == "qwen3_5":
        return make_checkpoint(root, "qwen", family="qwen3_5", pattern="*GG*G", seed=5)
    return make_checkpoint(root)


def _engine(model_dir, tier_path=None, reuse=True, policy="lru", branch=False):
    cache = {"tokens_per_block": 16, "num_blocks": 40, "num_state_slots": 6,
             "enable_prefix_reuse": reuse, "eviction": {"policy": policy},
             "mamba_state_config": {"additional_snapshot_offsets_from_end": [0],
                                    "decode_end_snapshot": True,
                                    "branch_point_snapshot": branch}}
    if tier_path is not None:
        # plain file I/O in this process: a process that has loaded NIXL crashes in
        # grpc_tools' protoc later (test_proto_stubs); NIXL's POSIX path is covered by
        # test_cache_tiers.py (in a subprocess) and the cluster test (workers use it)
        cache["tier"] = {"path": str(tier_path), "bytes": 64 << 20, "io": "file"}
    return engine_for(model_dir, cache=cache, worker={"max_num_seqs": 2})


def _chats(engine, sessions=SESSIONS, turns=TURNS):
    """Sessions take turns (s0 t0, s1 t0, ..., s0 t1, ...): each turn's history was pushed
    out of the 2-snapshot pool by the other sessions in between."""
    history = {s: [] for s in range(sessions)}
    toks, cached = {}, {}
    for t in range(turns):
        for s in range(sessions):
            p = history[s] + prompt(1000 * s + t, 20 + 3 * t)
            rid = f"s{s}t{t}"
            res = run_all(engine, [Request(rid, p, greedy(6), session=f"s{s}")])
            toks[rid] = res["tokens"][rid]
            cached[rid] = res["outputs"][rid].cached_tokens
            history[s] = p + toks[rid]
    return toks, cached


@pytest.fixture(scope="module")
def reference(model_dir):
    return _chats(_engine(model_dir, reuse=False))[0]


@pytest.mark.parametrize("policy, branch", [("lru", False), ("value", False), ("value", True)])
def test_small_pool_with_disk_tier_gives_reuse_off_tokens(model_dir, reference, tmp_path,
                                                          policy, branch):
    eng = _engine(model_dir, tmp_path, policy=policy, branch=branch)
    got, cached = _chats(eng)
    assert got == reference
    st = eng.cache.stats()
    assert st.tiers["disk"]["admitted"] > 0 and st.tiers["disk"]["hits"] > 0
    # every turn after the first reuses the whole previous turn (decode-end snapshot), from
    # the pool or the disk: the pool alone holds 2 snapshots for 4 sessions
    for s in range(SESSIONS):
        assert cached[f"s{s}t0"] == 0 and all(cached[f"s{s}t{t}"] > 0 for t in range(1, TURNS))
    assert st.tier_hit_tokens > 0
    eng.cache.check_integrity()


def test_without_tier_the_same_pool_recomputes_more(model_dir, reference, tmp_path):
    got, pool_only = _chats(_engine(model_dir))
    assert got == reference
    _, tiered = _chats(_engine(model_dir, tmp_path))
    assert sum(pool_only.values()) < sum(tiered.values())
    assert [k for k, v in pool_only.items() if v == 0 and not k.endswith("t0")]


def test_restart_and_corruption_keep_tokens_exact(model_dir, reference, tmp_path):
    first = _engine(model_dir, tmp_path)
    _chats(first, turns=2)
    first.cache.tiers.close()  # a worker that stops finishes its queued writes
    del first
    entries = sorted(n for n in os.listdir(tmp_path) if n.endswith(".snap"))
    assert entries
    for n in entries[::2]:  # damage every other entry's payload
        f = tmp_path / n
        raw = bytearray(f.read_bytes())
        raw[-7] ^= 0x10
        f.write_bytes(bytes(raw))
    # what a worker killed mid-write leaves (tests/unit/test_cache_tiers.py kills one for
    # real): its half-written temporary file, here beside a truncated copy of an entry
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname().replace("-", "_")
    half = (tmp_path / entries[1]).read_bytes()
    (tmp_path / f".tmp-{host}-{dead.pid}-abc").write_bytes(half[: len(half) // 2])
    truncated = tmp_path / (entries[1].split("-")[0] + "-" + "0" * 16 + ".snap")
    truncated.write_bytes(half[:-9])
    eng = _engine(model_dir, tmp_path)  # a new worker over its predecessor's folder
    got, _ = _chats(eng)
    assert got == reference
    st = eng.cache.stats().tiers["disk"]
    assert st["hits"] > 0 and st["corrupt"] > 0 and st["removed_tmp"] == 1
    eng.cache.tiers.flush()  # writes run in the background: none half-done once flushed
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert not truncated.exists()
    eng.cache.check_integrity()


def _shared_engine(model_dir, url):
    import os as _os

    from tests.unit.cache.test_cache_shared_tier import TOKEN

    _os.environ["BATON_CLUSTER_TOKEN"] = TOKEN  # the builder derives the store's password
    try:
        cache = {"tokens_per_block": 16, "num_blocks": 40, "num_state_slots": 6,
                 "shared_store": {"url": url},
                 "mamba_state_config": {"additional_snapshot_offsets_from_end": [0],
                                        "decode_end_snapshot": True}}
        eng = engine_for(model_dir, cache=cache, worker={"max_num_seqs": 2})
    finally:
        _os.environ.pop("BATON_CLUSTER_TOKEN", None)
    return eng


def test_shared_store_between_two_workers_and_stopped_mid_run(model_dir, reference):
    """Worker 1 serves the first turns, worker 2 (its own pool) the rest through the store;
    then the store dies and worker 2 goes on: the tokens of reuse off throughout."""
    from tests.support.redis_server import RedisServer, RedisUnavailable
    from tests.unit.cache.test_cache_shared_tier import TOKEN

    srv = RedisServer(TOKEN)
    try:
        srv.start()
    except RedisUnavailable as e:
        pytest.skip(str(e))
    try:
        w1, w2 = _shared_engine(model_dir, srv.url), _shared_engine(model_dir, srv.url)
        history = {s: [] for s in range(SESSIONS)}
        got, cached = {}, {}
        for t in range(TURNS):
            if t == TURNS - 1:
                srv.stop()
            for s in range(SESSIONS):
                eng = w1 if t < 2 else w2
                p = history[s] + prompt(1000 * s + t, 20 + 3 * t)
                rid = f"s{s}t{t}"
                res = run_all(eng, [Request(rid, p, greedy(6), session=f"s{s}")])
                got[rid], cached[rid] = res["tokens"][rid], res["outputs"][rid].cached_tokens
                history[s] = p + got[rid]
        assert got == reference
        assert w2.cache.stats().tiers["shared"]["hits"] > 0
        assert all(cached[f"s{s}t2"] > 0 for s in range(SESSIONS))  # from w1 via the store
        assert w2.cache.stats().tiers["shared"]["errors"] >= 1
        w1.cache.check_integrity()
        w2.cache.check_integrity()
    finally:
        srv.stop()


def test_exact_block_boundary_restore_never_applies_the_last_token_twice(model_dir, tmp_path):
    """A 32-token prompt (2 blocks of 16) snapshotted at its end, pushed out to disk; the same
    prompt again must not take that snapshot (its state holds token 32 already), while a
    33-token extension takes it from disk: both give the tokens of reuse off."""
    off = _engine(model_dir, reuse=False)
    eng = _engine(model_dir, tmp_path)
    p32 = prompt(4242, 32)
    cases = [("a", p32), ("fill0", prompt(1, 40)), ("fill1", prompt(2, 40)),
             ("fill2", prompt(3, 40)), ("ext", p32 + [77]), ("again", p32)]
    got, cached = {}, {}
    for rid, p in cases:
        res = run_all(eng, [Request(rid, p, greedy(5))])
        got[rid], cached[rid] = res["tokens"][rid], res["outputs"][rid].cached_tokens
        if rid == "fill2":  # the 32-token snapshot is on disk only now
            assert eng.cache.tree.match(p32 + [0], 32).cached_tokens == 0
            assert eng.cache.tiers.flush(30)  # the write runs in the background
            assert 32 in eng.cache.tiers.disk.lengths()
    ref = {rid: run_all(off, [Request(rid, p, greedy(5))])["tokens"][rid] for rid, p in cases}
    assert got == ref
    assert cached["again"] < 32 and cached["ext"] == 32
    assert eng.cache.stats().tiers["disk"]["hit_tokens"] == 32  # "ext", from disk


def test_branch_point_snapshots_are_exact(model_dir, tmp_path):
    """Three prompts share 40 tokens: the second is snapshotted where it leaves the first's
    KV (32, two full blocks), and the third restores those 32: the tokens of reuse off."""
    shared = prompt(9, 40)
    cases = [(r, shared + prompt(10 + i, 9 - 2 * i)) for i, r in enumerate("abc")]
    eng = _engine(model_dir, branch=True)
    off = _engine(model_dir, reuse=False)
    got, cached = {}, {}
    for rid, p in cases:
        res = run_all(eng, [Request(rid, p, greedy(5))])
        got[rid], cached[rid] = res["tokens"][rid], res["outputs"][rid].cached_tokens
    ref = {rid: run_all(off, [Request(rid, p, greedy(5))])["tokens"][rid] for rid, p in cases}
    assert got == ref and cached == {"a": 0, "b": 0, "c": 32}
