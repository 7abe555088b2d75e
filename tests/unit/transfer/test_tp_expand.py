"""The TP plan over real pools: every prefill rank of every prefill stage writes, through
`expand`'s addresses, into every decode rank of every decode stage (PP 1 or 2 on either
side, TP 1, 2, 4 on either side), and afterwards each decode rank's pools hold exactly the
reference shard of the request's blocks and slot, every other byte untouched, no byte
written twice.

Pools are allocated from the rank's local config (`nemotron_h.tp.local_config`), as a TP
engine's ranks allocate them; the TP-1 content is every element's index, cut per rank by
the test's own slicing (`test_tp_plan.reference_local`).
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch

from baton.errors import TransferError
from baton.model.nemotron_h.tp import local_config
from baton.model.partition import partition_layers
from baton.model.pools import Pools, PoolSpec
from baton.model.tp_shard import model_shards
from tests.unit.transfer.test_tp_plan import GROUPS1, GROUPS4, reference_local
from transfer.layout import StageLayout
from transfer.tp_plan import expand, plan_tp

TPB, NB, NS = 4, 6, 3
SRC_BLOCKS, DST_BLOCKS, SKIP = [3, 1, 4], [0, 5, 2], 1  # dst block 0: a held prefix
SRC_SLOT, DST_SLOT = 2, 1


def global_pools(cfg):
    """TP-1 content of the whole model: every element its index (exact in float32)."""
    out, start = {}, 0
    shapes = {"kv": (len(cfg.attention_layers), NB, 2, TPB, cfg.num_key_value_heads,
                     cfg.head_dim)}
    shapes.update({t.name: (len(cfg.state_layers), NS, *t.shape) for t in cfg.state_tensors})
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        out[name] = np.arange(start, start + n, dtype=np.float32).reshape(shape)
        start += n
    return out


def shard_pool(cfg, g, name, tp, r, layers):
    """Rank r's pool of tensor `name` for the stage holding global `layers`."""
    ids = cfg.attention_layers if name == "kv" else cfg.state_layers
    rows = [ids.index(x) for x in ids if x in layers]
    per = [[reference_local(cfg, name, tp, r, g[name][li, u]) for u in range(g[name].shape[1])]
           for li in rows]
    return np.array(per, dtype=np.float32)


def rank_pools(cfg, tp, layers, fill=None, g=None, r=0):
    p = Pools(PoolSpec.for_model(local_config(cfg, tp), num_blocks=NB, tokens_per_block=TPB,
                                 num_slots=NS, layers=layers))
    for name, t in [("kv", p.kv), *p.state.items()]:
        if t.numel():
            t.copy_(torch.from_numpy(shard_pool(cfg, g, name, tp, r, layers))
                    if fill is None else torch.full_like(t, fill))
    return p


def expected(cfg, g, name, tp, r, layers):
    """Decode rank r after the transfer: -1 except the request's blocks / slot."""
    full = shard_pool(cfg, g, name, tp, r, layers)
    want = np.full_like(full, -1)
    if want.size:
        if name == "kv":
            for s, d in list(zip(SRC_BLOCKS, DST_BLOCKS, strict=True))[SKIP:]:
                want[:, d] = full[:, s]
        else:
            want[:, DST_SLOT] = full[:, SRC_SLOT]
    return want


@pytest.mark.parametrize("cfg", [GROUPS4, GROUPS1], ids=["groups4", "groups1"])
@pytest.mark.parametrize("pp_src, pp_dst", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("tp_src, tp_dst", list(itertools.product((1, 2, 4), repeat=2)))
def test_real_pools_receive_exactly_their_shard(cfg, tp_src, tp_dst, pp_src, pp_dst):
    g = global_pools(cfg)
    plan = plan_tp(model_shards(cfg, tp_src, "float32", TPB),
                   model_shards(cfg, tp_dst, "float32", TPB))
    src_stages = partition_layers(cfg.num_layers, pp_src)
    dst_stages = partition_layers(cfg.num_layers, pp_dst)
    src = {(k, r): rank_pools(cfg, tp_src, ly, g=g, r=r)
           for k, ly in enumerate(src_stages) for r in range(tp_src)}
    dst = {(k, r): rank_pools(cfg, tp_dst, ly, fill=-1.0)
           for k, ly in enumerate(dst_stages) for r in range(tp_dst)}
    written = []
    for (sk, sr), (dk, dr) in itertools.product(src, dst):
        pieces = [p for p in plan if p.src_rank == sr and p.dst_rank == dr]
        desc = expand(pieces, StageLayout.from_pools(src[sk, sr]),
                      StageLayout.from_pools(dst[dk, dr]), SRC_BLOCKS, SRC_SLOT, DST_BLOCKS,
                      DST_SLOT, SKIP)
        s_ranges, d_ranges = desc.coalesced()
        for (sa, n), (da, _) in zip(s_ranges.tolist(), d_ranges.tolist(), strict=True):
            ctypes.memmove(da, sa, n)
            written.append((da, da + n))
    written.sort()
    assert all(a[1] <= b[0] for a, b in zip(written, written[1:], strict=False)), \
        "a destination byte was written twice"
    for (dk, dr), p in dst.items():
        for name, t in [("kv", p.kv), *p.state.items()]:
            want = expected(cfg, g, name, tp_dst, dr, dst_stages[dk])
            if t.numel() == 0:  # a stage without attention (or state) layers
                assert want.size == 0
                continue
            assert np.array_equal(t.numpy(), want), (name, dk, dr)


def test_expand_refuses_a_layout_it_was_not_planned_for():
    """Pieces planned for TP 1 -> 2 posted into a TP-4 rank's pools: refused, nothing built."""
    plan = plan_tp(model_shards(GROUPS4, 1, "float32", TPB),
                   model_shards(GROUPS4, 2, "float32", TPB))
    g = global_pools(GROUPS4)
    src = StageLayout.from_pools(rank_pools(GROUPS4, 1, range(4), g=g))
    wrong = StageLayout.from_pools(rank_pools(GROUPS4, 4, range(4), fill=-1.0))
    # (KV fits: 2 KV heads give one head per rank at TP 2 and at TP 4; the conv slot
    # [x 8 | B 4 | C 4] x 3 floats at TP 4 is smaller than the planned TP-2 runs)
    with pytest.raises(TransferError, match=r"conv piece 0->0 runs past a 768-byte source or "
                                            r"192-byte destination unit"):
        expand([p for p in plan if p.dst_rank == 0], src, wrong, SRC_BLOCKS, SRC_SLOT,
               DST_BLOCKS, DST_SLOT, SKIP)


def snapshot_pools(cfg, tp, layers, g=None, r=0, fill=None):
    """A rank's pools split as a bf16-state engine's (2 live slots, 1 bf16 snapshot slot,
    id 2), the snapshot slot holding the reference shard of slot SRC_SLOT as int16 bits (a
    bf16 value is its bits: the test compares them, not numbers)."""
    spec = PoolSpec.for_model(local_config(cfg, tp), num_blocks=NB, tokens_per_block=TPB,
                              num_slots=NS, layers=layers)
    p = Pools(spec.split_snapshots(2, {t.name: torch.bfloat16 for t in spec.state_tensors}))
    for name, t in p.snapshots.items():
        bits = t.view(torch.int16)
        if fill is not None:
            bits.fill_(fill)
        elif bits.numel():
            want = shard_pool(cfg, g, name, tp, r, layers)[:, SRC_SLOT]
            bits[:, 0].copy_(torch.from_numpy((want % 30000).astype(np.int16)))
    return p


@pytest.mark.parametrize("pp_src, pp_dst", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("tp_src, tp_dst", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_16bit_snapshot_slots_receive_exactly_their_shard(tp_src, tp_dst, pp_src, pp_dst):
    """16-bit state handoffs with TP workers (docs/state-precision.md): pieces planned in the
    float32 pools' bytes, sent from a bf16 snapshot slot into a bf16 snapshot slot, are
    rescaled to 2-byte elements; each decode rank's snapshot slot then holds exactly its
    shard, its live slots and every other byte untouched, no byte written twice."""
    cfg = GROUPS1
    g = global_pools(cfg)
    plan = plan_tp(model_shards(cfg, tp_src, "float32", TPB),
                   model_shards(cfg, tp_dst, "float32", TPB))
    src_stages = partition_layers(cfg.num_layers, pp_src)
    dst_stages = partition_layers(cfg.num_layers, pp_dst)
    src = {(k, r): snapshot_pools(cfg, tp_src, ly, g=g, r=r)
           for k, ly in enumerate(src_stages) for r in range(tp_src)}
    dst = {(k, r): snapshot_pools(cfg, tp_dst, ly, fill=-1)
           for k, ly in enumerate(dst_stages) for r in range(tp_dst)}
    for p in dst.values():
        for t in p.state.values():
            t.fill_(-1.0)
    written, state_bytes = [], 0
    for (sk, sr), (dk, dr) in itertools.product(src, dst):
        pieces = [p for p in plan if p.src_rank == sr and p.dst_rank == dr
                  and p.tensor != "kv"]
        desc = expand(pieces, StageLayout.from_pools(src[sk, sr]),
                      StageLayout.from_pools(dst[dk, dr]), [], 2, [], 2)
        s_ranges, d_ranges = desc.coalesced()
        state_bytes += desc.nbytes
        for (sa, n), (da, _) in zip(s_ranges.tolist(), d_ranges.tolist(), strict=True):
            ctypes.memmove(da, sa, n)
            written.append((da, da + n))
    written.sort()
    assert all(a[1] <= b[0] for a, b in zip(written, written[1:], strict=False))
    f32 = 0
    for (dk, dr), p in dst.items():
        for name, t in p.snapshots.items():
            if not t.numel():
                continue
            want = shard_pool(cfg, g, name, tp_dst, dr, dst_stages[dk])[:, SRC_SLOT]
            assert np.array_equal(t.view(torch.int16)[:, 0].numpy(),
                                  (want % 30000).astype(np.int16)), (name, dk, dr)
            f32 += want.size * 4
        for t in p.state.values():  # the live float32 slots: not a byte written
            assert (t == -1.0).all()
    assert 2 * state_bytes == f32  # half the float32 bytes


def test_tp_pieces_refuse_live_to_snapshot():
    """A float32 live slot into a bf16 snapshot slot: refused in one line, nothing built."""
    plan = plan_tp(model_shards(GROUPS1, 2, "float32", TPB),
                   model_shards(GROUPS1, 1, "float32", TPB))
    g = global_pools(GROUPS1)
    src = StageLayout.from_pools(snapshot_pools(GROUPS1, 2, range(4), g=g))
    dst = StageLayout.from_pools(snapshot_pools(GROUPS1, 1, range(4), fill=-1))
    pieces = [p for p in plan if p.src_rank == 0 and p.tensor != "kv"]
    with pytest.raises(TransferError, match=r"state\.\w+ slot bytes differ: source slot 1 "
                                            r"holds \d+ of \d+ live bytes, destination slot 2"):
        expand(pieces, src, dst, [], 1, [], 2)
