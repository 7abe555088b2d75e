"""Heterogeneous tensor-parallel handoffs over NIXL between real processes, bit-exact: every
pair of prefill TP and decode TP in {1, 2, 4}, PP on either side and TP x PP on either side,
on NemotronH with n_groups 1 / one KV head (B/C and KV replicated on every rank) and with
n_groups 4 / two KV heads (split, KV replicated at TP 4). Each rank is its own process with its
own NIXL agent (the loopback stage processes, forked once and set up again per case).

The oracle (`bench/harness/tp_bytes.py`) does not use the plan: each prefill stage's bytes are
seeded at TP 1 and every rank holds its shard of them, so after the handoffs decode rank d of
TP q must hold its shard of the source blocks and slot in the reserved ones and its canary
bytes everywhere else (no byte lost, misplaced, or written outside the reservation).
"""

from __future__ import annotations

import pytest
import torch

from baton.model.config import config_from_dict
from baton.model.nemotron_h.tp import local_config
from baton.model.pools import Pools, PoolSpec
from bench.harness import tp_bytes
from bench.harness.testbed import Testbed, tiny_model, two_handoffs
from bench.harness.verify import first_difference, split_layers, views

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODELS = {"groups1-kv1": tiny_model("M*M-M*", n_groups=1, num_key_value_heads=1,
                                    intermediate_size=64),
          "groups4-kv2": tiny_model("M*M-M*", n_groups=4, intermediate_size=64)}
SIZES = dict(num_blocks=12, tokens_per_block=4, num_slots=3)
CASES = [(p, 1, q, 1) for p in (1, 2, 4) for q in (1, 2, 4)] + [
    (2, 1, 1, 2), (1, 2, 2, 1),  # TP on one side, PP on the other (as the workers run them)
    (2, 2, 1, 2), (1, 2, 2, 2), (2, 2, 4, 1)]  # TP x PP on a side (the local engine's layout)
"""(prefill TP, prefill PP, decode TP, decode PP)."""


@pytest.fixture(scope="module")
def bed():
    tb = Testbed(max_prefill=4, max_decode=4)
    yield tb
    tb.close()


def _places(tp: int, pp: int, layers: int) -> list[tuple[list[int], int]]:
    """(layers, TP rank) of every process of a side, stage-major."""
    return [(stage, r) for stage in split_layers(layers, pp) for r in range(tp)]


def _run_case(bed, model: dict, p: int, pp: int, q: int, dp: int, seed: int, tag: str):
    mc = config_from_dict(model)
    pre, dec = _places(p, pp, mc.num_layers), _places(q, dp, mc.num_layers)
    seeds = {tuple(layers): seed + i for i, layers in enumerate(split_layers(mc.num_layers, pp))}
    for procs, places, role, tp in ((bed.prefill, pre, "prefill", p),
                                    (bed.decode, dec, "decode", q)):
        for proc, (layers, r) in zip(procs, places, strict=False):
            proc.submit("setup", role=role, backend="nixl", model=model, layers=layers,
                        seed=seeds[tuple(layers)] if role == "prefill" else -1,
                        tp=[r, tp], **SIZES)
    replies = [x.result() for x in bed.prefill[:len(pre)] + bed.decode[:len(dec)]]
    assert all(r["ok"] for r in replies), [r.get("error") for r in replies]
    endpoints = [r["endpoint"] for r in replies[len(pre):]]
    before = [x.call("dump") for x in bed.decode[:len(dec)]]
    hs = two_handoffs(tag)
    for x in bed.decode[:len(dec)]:
        x.call("batch", calls=[["expect", dict(rid=h.rid, blocks=h.dst_blocks[h.skip:],
                                               slot=h.dst_slot)] for h in hs])
    for x in bed.prefill[:len(pre)]:
        x.call("batch", calls=[["send", dict(
            rid=h.rid, endpoints=endpoints, src_blocks=h.src_blocks, src_slot=h.src_slot,
            dst_blocks=h.dst_blocks, dst_slot=h.dst_slot, skip=h.skip)] for h in hs])
    for x in bed.prefill[:len(pre)] + bed.decode[:len(dec)]:
        x.submit("wait", rids=[h.rid for h in hs], timeout=20.0)
    for x in bed.prefill[:len(pre)] + bed.decode[:len(dec)]:
        events = x.result(40)["events"]
        assert sorted(events) == sorted([h.rid, True, None] for h in hs), (tag, events)
    sources = [tp_bytes.whole_pools(mc, layers, seed=s, **SIZES) for layers, s in
               ((list(k), v) for k, v in seeds.items())]
    for j, ((layers, r), x) in enumerate(zip(dec, bed.decode, strict=False)):
        spec = PoolSpec.for_model(local_config(mc, q), layers=layers, dtype=torch.float32,
                                  **SIZES)
        mine = Pools(spec)
        for name, t in {"kv": mine.kv, **mine.state}.items():
            t.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(before[j][name]),
                                                                dtype=torch.uint8))
        want = tp_bytes.expected(mine, mc, r, q, sources, hs)
        diff = first_difference(views(want, spec), views(x.call("dump"), spec))
        assert diff is None, f"{tag}: decode rank {r} of layers {layers}: {diff}"


@pytest.mark.parametrize("name", list(MODELS))
def test_every_tp_pair_and_pp_on_either_side_bit_exact(bed, name):
    for i, (p, pp, q, dp) in enumerate(CASES):
        _run_case(bed, MODELS[name], p, pp, q, dp, seed=100 * i + 1,
                  tag=f"{name}-p{p}x{pp}-d{q}x{dp}")
