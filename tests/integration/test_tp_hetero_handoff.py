"""Prefill TP p -> decode TP q through the TP plan, for every pair in {1, 2, 4}, in one
process (no workers, no network: what the cluster's transfer would move, moved here).

A prefill engine at TP p computes each prompt (prefill only); every rank's bytes of the
request's blocks and slot are read back; the plan p -> q (`plan_tp` + `expand`, posted as
memmoves over the coalesced ranges, as the UCX backend posts them) writes them into staging
pools holding each decode rank's shard; those are written into a TP-q decode engine's
reservation, which decodes from the prefill's first token. Tokens must equal the TP-1
local engine's exactly (margin-filtered prompts, see test_tp_engine).
"""

from __future__ import annotations

import ctypes
import itertools

import pytest

from baton.engine.request import Request
from baton.engine.tp.rank import dump_request, load_request
from baton.model.nemotron_h.tp import family_tp
from baton.model.pools import Pools, PoolSpec
from baton.model.tp_shard import model_shards
from tests.engine_helpers import engine_for, greedy
from tests.integration.test_tp_engine import STEPS, WORKER, case, env, explain  # noqa: F401
from transfer.layout import StageLayout
from transfer.tp_plan import expand, plan_tp

TPS = (1, 2, 4)


def _engine(path, tp):
    return engine_for(path, worker={**WORKER, "tensor_parallel_size": tp})


def _close(eng):
    close = getattr(eng.model, "close", None)
    if close is not None:
        close()


def prefill_dumps(path, tp, prompts) -> dict:
    """{request: (per-rank bytes, blocks, first token)} of a TP-`tp` prefill."""
    eng = _engine(path, tp)
    out = {}
    try:
        tpb = eng.pools.spec.tokens_per_block
        for rid, ids in prompts.items():
            eng.add_request(Request(rid, list(ids), greedy(1), prefill_only=True))
        while len(out) < len(prompts):
            for o in eng.step():
                if o.finished:
                    nb = -(-len(prompts[o.request_id]) // tpb)
                    blocks = eng.cache.block_table(o.request_id)[:nb]
                    slot = eng.cache.slot(o.request_id)
                    data = [dump_request(eng.pools, blocks, slot)] if tp == 1 else \
                        eng.model.dump(blocks, slot)
                    out[o.request_id] = (data, nb, o.new_token_ids[0])
                    eng.release(o.request_id)
    finally:
        _close(eng)
    return out


def staging(cfg, tp, nb, tpb, data=None) -> Pools:
    """One rank's shard-shaped pools of one request: blocks 0..nb-1, slot 0."""
    p = Pools(PoolSpec.for_model(family_tp(cfg).local_config(cfg, tp), num_blocks=nb,
                                 tokens_per_block=tpb, num_slots=1))
    if data is not None:
        load_request(p, data, list(range(nb)), 0)
    else:
        p.kv.fill_(-1.0)
        for t in p.state.values():
            t.fill_(-1.0)
    return p


def move(cfg, tpb, p, q, data, nb) -> list[dict]:
    """The plan p -> q applied rank pair by rank pair; each decode rank's bytes after it."""
    plan = plan_tp(model_shards(cfg, p, "float32", tpb), model_shards(cfg, q, "float32", tpb))
    src = [staging(cfg, p, nb, tpb, d) for d in data]
    dst = [staging(cfg, q, nb, tpb) for _ in range(q)]
    blocks = list(range(nb))
    for i, j in itertools.product(range(p), range(q)):
        desc = expand([x for x in plan if x.src_rank == i and x.dst_rank == j],
                      StageLayout.from_pools(src[i]), StageLayout.from_pools(dst[j]),
                      blocks, 0, blocks, 0)
        s, d = desc.coalesced()
        for (sa, n), (da, _) in zip(s.tolist(), d.tolist(), strict=True):
            ctypes.memmove(da, sa, n)
    for j, pools in enumerate(dst):  # nothing left unwritten (no -1 survived)
        assert not (pools.kv == -1).any() and all(not (t == -1).any()
                                                 for t in pools.state.values()), (p, q, j)
    return [dump_request(x, blocks, 0) for x in dst]


@pytest.mark.parametrize("case", ["groups1-kv1", "qwen3_5"], indirect=True)
def test_prefill_tp_to_decode_tp_equals_local(case):  # noqa: F811
    path, kept, _, ref, _, margins = case
    dumps = {p: prefill_dumps(path, p, kept) for p in TPS}
    for rid, (_, _, first) in dumps[1].items():
        assert first == ref[rid][0]
    for q in TPS:
        eng = _engine(path, q)
        try:
            cfg = eng.model.config
            tpb = eng.pools.spec.tokens_per_block
            for p in TPS:
                got = {}
                for rid, (data, nb, first) in dumps[p].items():
                    req = f"{rid}-p{p}"
                    eng.reserve_remote(Request(req, list(kept[rid]), greedy(STEPS)))
                    blocks = eng.cache.block_table(req)[:nb]
                    slot = eng.cache.slot(req)
                    moved = move(cfg, tpb, p, q, data, nb)
                    if q == 1:
                        load_request(eng.pools, moved[0], blocks, slot)
                    else:
                        eng.model.load(moved, blocks, slot)
                    got[rid] = list(eng.start_remote(req, first)[0].new_token_ids)
                while eng.has_work:
                    for o in eng.step():
                        got[o.request_id.rsplit("-p", 1)[0]] += list(o.new_token_ids)
                assert got == ref, f"prefill TP {p} -> decode TP {q}:\n" + explain(
                    got, ref, margins)
            eng.cache.check_integrity()
        finally:
            _close(eng)
