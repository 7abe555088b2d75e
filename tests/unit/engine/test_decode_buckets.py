"""Bucketed decode steps (`worker.decode_batch_buckets`, baton/engine/decode_batch.py): every
decode forward has a bucket's batch size and a power-of-two table width, its pad rows write
only the cache's pad block and slot (never handed out), a dense model reads none of the step's
tensors on the host, and every real row's tokens, state slot and KV blocks are bit for bit
those of an unbucketed engine running the same workload in lockstep."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from baton.config import BatonConfig
from baton.engine.request import Request
from baton.errors import ConfigError
from baton.model.layers import linear
from tests.support.engine_helpers import (
    engine_for,
    greedy,
    make_checkpoint,
    prompt,
    run_staggered,
    staggered,
)
from tests.support.speculative_helpers import agreeing_checkpoint

BUCKETS = [1, 2, 4, 8]
FAMILIES = {
    "nemotron_h": {},
    "qwen3_5": {"family": "qwen3_5"},
    "qwen3_5_moe": {"family": "qwen3_5_moe", "seed": 4},
    "nemotron_h_moe": {"pattern": "M*ME", "n_routed_experts": 8, "num_experts_per_tok": 2},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("buckets")
    return {name: make_checkpoint(root, name, **kw) for name, kw in FAMILIES.items()}


def _engine(model_dir, buckets, **worker):
    return engine_for(model_dir, worker={"max_num_seqs": 6, "prefill_chunk_size": 8,
                                         "decode_batch_buckets": buckets, **worker},
                      cache={"tokens_per_block": 4, "num_blocks": 256})


def _record_shapes(eng, pad_zero: list | None = None) -> list[tuple[int, int, int, bool]]:
    """(real rows, rows, table columns, static) of every decode forward of `eng`;
    `pad_zero` gets whether the pad slot was all zeros when each forward began."""
    seen, decode, update = [], eng.model.decode, eng.batch.update
    real = []

    def rec_update(reqs):
        real.append(len(reqs))
        return update(reqs)

    def rec(ids, pos, tables, slots, pools, **kw):
        seen.append((real[-1], ids.shape[0], tables.shape[1], bool(kw.get("static"))))
        if pad_zero is not None:
            pad_zero.append(all(not t[:, eng.cache.pad_slot].any()
                                for t in pools.state.values()))
        return decode(ids, pos, tables, slots, pools, **kw)

    eng.batch.update, eng.model.decode = rec_update, rec
    return seen


def _same_state(a, b, reqs) -> None:
    """Every running request's slot id, table, state slot and KV blocks equal bit for bit."""
    for r in reqs:
        if r.id not in a.cache.live_requests():
            continue
        sa, sb = a.cache.slot(r.id), b.cache.slot(r.id)
        ta, tb = a.cache.block_table(r.id), b.cache.block_table(r.id)
        assert (sa, ta) == (sb, tb), r.id
        for name, t in a.pools.state.items():
            assert torch.equal(t[:, sa], b.pools.state[name][:, sb]), (r.id, name)
        if a.pools.has_kv:
            assert torch.equal(a.pools.kv[:, ta], b.pools.kv[:, tb]), r.id


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bucketed_steps_equal_unbucketed_in_lockstep(checkpoints, family):
    plain, bucketed = (_engine(checkpoints[family], b) for b in ([], BUCKETS))
    pad_zero = []
    shapes = _record_shapes(bucketed, pad_zero)
    pad_slot, pad_block = bucketed.cache.pad_slot, bucketed.cache.pad_block
    pending = [staggered(), staggered()]
    tokens = [{}, {}]
    pad_finite = []
    for step in range(400):
        for eng, todo, out in zip((plain, bucketed), pending, tokens, strict=True):
            for _, r in [x for x in todo if x[0] <= step]:
                eng.add_request(r)
            todo[:] = [x for x in todo if x[0] > step]
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        _same_state(plain, bucketed, bucketed.requests.values())
        if shapes and shapes[-1][0] < shapes[-1][1]:  # padded: the pad rows wrote the pad slot
            pad_finite.append(all(torch.isfinite(t[:, pad_slot]).all()
                                  for t in bucketed.pools.state.values()))
        if not any(pending) and not plain.has_work and not bucketed.has_work:
            break
    assert tokens[0] == tokens[1] and sum(map(len, tokens[0].values())) > 250
    # the workload ran batches of sizes that are not buckets, padded up to the next one
    assert {r for r, *_ in shapes} == {1, 2, 3, 4, 5, 6}
    assert all(n == next(x for x in BUCKETS if x >= r) and s for r, n, _, s in shapes)
    assert {w for *_, w, _ in shapes} == {4, 8, 16}  # powers of two, grown as tables grew
    # pad rows: token 0 at position 0 from a pad slot zeroed before every step, so they
    # never carry anything from step to step (nor grow without bound)
    assert len(pad_finite) > 20 and all(pad_finite)
    assert len(pad_zero) == len(shapes) and all(pad_zero)
    # nothing handed out the pad block or slot, and nothing leaked
    for eng in (plain, bucketed):
        eng.cache.check_integrity()
        assert eng.cache.stats().slots_live == 0
    assert pad_block == bucketed.pools.spec.num_blocks - 1
    assert bucketed.cache.stats().blocks_total == plain.cache.stats().blocks_total - 1
    assert pad_block not in bucketed.cache.blocks.free_ids()
    assert pad_slot not in bucketed.cache.slots.free_ids()
    assert bucketed.cache.slots.num_slots == plain.cache.slots.num_slots - 1


def test_bucketed_reference_path_gives_the_same_tokens(checkpoints):
    """The reference path pads its keys to the table's width (masked): the same tokens."""
    old = linear.set_decode_path("reference")
    try:
        runs = []
        for buckets in ([], BUCKETS):
            eng = _engine(checkpoints["nemotron_h"], buckets)
            out = run_staggered(eng, staggered(6))
            runs.append(out)
        assert runs[0] == runs[1] and sum(map(len, runs[0].values())) > 100
    finally:
        linear.set_decode_path(old)


def test_a_batch_past_the_last_bucket_runs_unpadded(checkpoints):
    eng = _engine(checkpoints["nemotron_h"], [1, 2])
    shapes = _record_shapes(eng)
    reqs = [Request(f"w{i}", prompt(70 + i, 6), greedy(6)) for i in range(4)]
    for r in reqs:
        eng.add_request(r)
    while eng.has_work:
        eng.step()
    assert (4, 4) in {(r, n) for r, n, *_ in shapes}
    assert all(n == r or n in (1, 2) for r, n, *_ in shapes)


class _HostReads(TorchDispatchMode):
    """Ops that read a tensor's values on the host (a device sync), or give data-dependent
    shapes."""

    READS = ("_local_scalar_dense", "item", "nonzero", "bincount", "unique", "masked_select")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(k in str(func) for k in self.READS):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _host_reads(eng) -> list[str]:
    """What one decode forward of `eng` read on the host (ops and `Tensor.tolist` calls)."""
    seen: list[str] = []
    decode, tolist = eng.model.decode, torch.Tensor.tolist

    def spied(*a, **k):
        def listed(t):
            seen.append("tolist")
            return tolist(t)

        torch.Tensor.tolist = listed
        try:
            with _HostReads() as spy:
                out = decode(*a, **k)
        finally:
            torch.Tensor.tolist = tolist
        seen.extend(spy.seen)
        return out

    eng.model.decode = spied
    try:
        eng.step()
    finally:
        eng.model.decode = decode
    return seen


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
@pytest.mark.parametrize("path", ["reference", "fast"])
def test_a_dense_bucketed_decode_reads_nothing_on_the_host(checkpoints, family, path):
    """The forward CUDA graphs would capture: no host read of positions, slots or tables (the
    unbucketed step reads them, which shows the spy sees such reads)."""
    old = linear.set_decode_path(path)
    try:
        seen = {}
        for buckets in ([], BUCKETS):
            eng = _engine(checkpoints[family], buckets)
            for i in range(3):
                eng.add_request(Request(f"h{i}", prompt(i, 5 + i), greedy(20)))
            for _ in range(6):
                eng.step()
            assert all(len(r.output_ids) >= 2 for r in eng.requests.values())
            seen[bool(buckets)] = _host_reads(eng)
        assert seen[True] == []
        assert "tolist" in seen[False] and "aten.item.default" in seen[False]
    finally:
        linear.set_decode_path(old)


def test_a_padded_forward_returns_only_the_real_rows(checkpoints):
    """Logits and the hiddens an MTP head reads: the batch's 3 rows, the bits an unbucketed
    forward gives them (the pad row is cut off)."""
    got = []
    for buckets in ([], BUCKETS):
        eng = _engine(checkpoints["nemotron_h"], buckets)
        reqs = [Request(f"p{i}", prompt(50 + i, 4 + 3 * i), greedy(30)) for i in range(3)]
        for r in reqs:
            eng.add_request(r)
        for _ in range(4):
            eng.step()
        hidden: list[torch.Tensor] = []
        got.append((eng._decode(reqs, hidden), hidden))
    (la, ha), (lb, hb) = got
    assert lb.shape == la.shape == (3, la.shape[1]) and torch.equal(la, lb)
    assert len(ha) == len(hb) == 1 and hb[0].shape[0] == 3 and torch.equal(ha[0], hb[0])


def test_bucketed_decode_under_speculation_gives_the_same_tokens(tmp_path):
    """Speculation's plain steps (past its `max_batch`) take the padded path; their hiddens
    (what the MTP head reads) are cut to the real rows."""
    ck = agreeing_checkpoint(tmp_path)
    runs = []
    for buckets in ([], BUCKETS):
        eng = engine_for(ck, worker={"max_num_seqs": 6, "decode_batch_buckets": buckets},
                         cache={"tokens_per_block": 4, "num_blocks": 256,
                                "num_state_slots": 64},
                         speculative={"num_draft_tokens": 2, "max_batch": 2})
        out = run_staggered(eng, staggered(8))
        eng.cache.check_integrity()
        runs.append((out, eng.spec.draft_tokens))
    assert runs[0] == runs[1] and runs[0][1] > 0
    assert sum(map(len, runs[0][0].values())) > 150


@pytest.mark.parametrize("bad", [[2, 1], [0, 4], [1, 1], [-2]])
def test_bad_buckets_are_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match="decode_batch_buckets"):
        BatonConfig.from_dict({"worker": {"decode_batch_buckets": bad}})
