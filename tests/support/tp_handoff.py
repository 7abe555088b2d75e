"""Moving one request's cache between TP engines of different sizes through the TP plan,
in one process (what the cluster's transfer would move, moved here): read every rank's
bytes of the request's blocks and slot, apply `plan_tp` + `expand` rank pair by rank pair
(memmoves over the coalesced ranges, as the UCX backend posts them) into staging pools of
each decode rank's shard, and write those into a decode engine's reservation."""

from __future__ import annotations

import ctypes
import itertools

from baton.engine.request import Request
from baton.engine.tp.rank import dump_request, load_request
from baton.model.pools import Pools, PoolSpec
from baton.model.tp_loader import family_tp
from baton.model.tp_shard import model_shards
from tests.support.engine_helpers import greedy
from transfer.layout import StageLayout
from transfer.tp_plan import expand, plan_tp


def tp_of(eng) -> int:
    tp = getattr(eng.model, "tp", None)
    return tp.size if tp is not None else 1


def prefill_dump(eng, prompts: dict) -> dict:
    """{request: (per-rank bytes, blocks, first token)} of a prefill-only run on `eng`."""
    out = {}
    tpb = eng.pools.spec.tokens_per_block
    for rid, ids in prompts.items():
        eng.add_request(Request(f"{rid}-dump", list(ids), greedy(1), prefill_only=True))
    while len(out) < len(prompts):
        for o in eng.step():
            if o.finished:
                rid = o.request_id.removesuffix("-dump")
                nb = -(-len(prompts[rid]) // tpb)
                blocks = eng.cache.block_table(o.request_id)[:nb]
                slot = eng.cache.slot(o.request_id)
                data = eng.model.dump(blocks, slot) if tp_of(eng) > 1 else \
                    [dump_request(eng.pools, blocks, slot)]
                out[rid] = (data, nb, o.new_token_ids[0])
                eng.release(o.request_id)
    return out


def decode_from(eng, cfg, p: int, dumps: dict, prompts: dict, steps: int) -> dict:
    """Tokens of each request decoded on `eng` from a TP-`p` prefill's bytes."""
    q, tpb = tp_of(eng), eng.pools.spec.tokens_per_block
    got = {}
    for rid, (data, nb, first) in dumps.items():
        req = f"{rid}-p{p}"
        adm = eng.reserve_remote(Request(req, list(prompts[rid]), greedy(steps)))
        skip = adm.cached_tokens // tpb  # a prefix this engine holds: left as it is
        blocks = eng.cache.block_table(req)[:nb]
        slot = eng.cache.slot(req)
        moved = move(cfg, tpb, p, q, data, nb)
        if q == 1:
            load_request(eng.pools, moved[0], blocks, slot, skip)
        else:
            eng.model.load(moved, blocks, slot, skip)
        got[rid] = list(eng.start_remote(req, first)[0].new_token_ids)
    while eng.has_work:
        for o in eng.step():
            got[o.request_id.rsplit("-p", 1)[0]] += list(o.new_token_ids)
    return got


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


