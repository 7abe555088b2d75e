"""Planner: exact descriptor addresses, coalescing, skipping, stage intersections."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from baton.errors import TransferError
from transfer.layout import KVLayout, StageLayout, StateLayout, TensorLayout
from transfer.planner import coalesce, plan

#   src KV: layers (1, 3) at 0x10000, layer stride 0x1000, block stride/bytes 0x100, 16 blocks
#   dst KV: layers (3, 5) at 0x40000, same strides
#   src state: layers (0, 2), 3 slots: conv at 0x80000 (slot 0x100, layer 0x300),
#              ssm at 0x90000 (slot 0x200, layer 0x600)
#   dst state: layer (2,), 2 slots: conv at 0xA0000, ssm at 0xB0000


def kv(base, layers):
    return KVLayout(layers=layers, base=base, layer_stride=0x1000, block_stride=0x100,
                    block_bytes=0x100, k_bytes=0x80, num_blocks=16)


def state(conv, ssm, layers, slots):
    return StateLayout(layers=layers, num_slots=slots, tensors=(
        TensorLayout("conv", base=conv, layer_stride=0x100 * slots, slot_stride=0x100,
                     bytes=0x100, section_bytes=(0x80, 0x40, 0x40)),
        TensorLayout("ssm", base=ssm, layer_stride=0x200 * slots, slot_stride=0x200,
                     bytes=0x200, section_bytes=(0x200,))))


SRC = StageLayout(kv(0x10000, (1, 3)), state(0x80000, 0x90000, (0, 2), 3), "float32", "cpu", 0)
DST = StageLayout(kv(0x40000, (3, 5)), state(0xA0000, 0xB0000, (2,), 2), "float32", "cpu", 0)


def rows(a):
    return [tuple(int(x) for x in r) for r in a]


def test_exact_addresses_of_the_shared_layers():
    p = plan(SRC, DST, [2, 3, 4], 1, [7, 8, 9], 0)
    assert p.layers == (2, 3)
    # kv layer 3: src local 1, dst local 0; then conv, ssm of layer 2: src local 1, dst local 0
    assert [hex(a) for a in p.src_addr] == ["0x11200", "0x11300", "0x11400", "0x80400", "0x90800"]
    assert [hex(a) for a in p.dst_addr] == ["0x40700", "0x40800", "0x40900", "0xa0000", "0xb0000"]
    assert p.length.tolist() == [0x100, 0x100, 0x100, 0x100, 0x200]
    assert p.unit_layer.tolist() == [3, 3, 3, 2, 2]
    src, dst = p.coalesced()
    assert rows(src) == [(0x11200, 0x300), (0x80400, 0x100), (0x90800, 0x200)]
    assert rows(dst) == [(0x40700, 0x300), (0xA0000, 0x100), (0xB0000, 0x200)]
    assert p.nbytes == 0x600


def test_units_index_the_prepped_unit_tables():
    p = plan(SRC, DST, [2, 3, 4], 1, [7, 8, 9], 0)
    st, dt = SRC.unit_table(), DST.unit_table()
    assert (st[p.src_units, 0] == p.src_addr).all() and (st[p.src_units, 1] == p.length).all()
    assert (dt[p.dst_units, 0] == p.dst_addr).all() and (dt[p.dst_units, 1] == p.length).all()
    assert len(st) == 2 * 16 + 2 * 3 * 2 and len(dt) == 2 * 16 + 1 * 2 * 2


def test_coalesces_only_where_both_sides_are_contiguous():
    p = plan(SRC, DST, [2, 3, 4, 9], 0, [7, 9, 8, 10], 1)
    src, dst = p.coalesced()
    kv_src = [r for r in rows(src) if r[0] < 0x80000]
    assert kv_src == [(0x11200, 0x100), (0x11300, 0x100), (0x11400, 0x100), (0x11900, 0x100)]
    reversed_both = plan(SRC, DST, [4, 5], 0, [8, 9], 1).coalesced()[0]
    assert rows(reversed_both)[0] == (0x11400, 0x200)


def test_skip_blocks_leaves_out_the_held_prefix():
    p = plan(SRC, DST, [2, 3, 4], 1, [7, 8, 9], 0, skip_blocks=2)
    assert [hex(a) for a in p.dst_addr[:1]] == ["0x40900"]
    everything_held = plan(SRC, DST, [2, 3], 1, [7, 8], 0, skip_blocks=2)
    assert everything_held.layers == (2, 3)  # still covered: the decode side must hear of it
    assert everything_held.unit_layer.tolist() == [2, 2]


def test_attention_free_and_mamba_free_stages():
    attn_free = StageLayout(None, state(0xA0000, 0xB0000, (0, 2), 2), "float32", "cpu", 0)
    mamba_free = StageLayout(kv(0x40000, (1, 3)), None, "float32", "cpu", 0)
    p = plan(SRC, attn_free, [1], 2, [1], 1)
    assert p.layers == (0, 2) and p.length.tolist() == [0x100, 0x100, 0x200, 0x200]
    q = plan(SRC, mamba_free, [1], None, [1], None)
    assert q.layers == (1, 3) and q.length.tolist() == [0x100, 0x100]
    none = plan(attn_free, mamba_free, [1], 0, [1], None)
    assert none.layers == () and none.length.size == 0


def test_every_layer_covered_exactly_once_across_stage_pairs():
    def stage(layers):
        a = tuple(g for g in layers if g % 2)
        m = tuple(g for g in layers if not g % 2)
        return StageLayout(kv(0x10000 * (layers[0] + 1), a) if a else None,
                           state(0x900000, 0xA00000, m, 2) if m else None, "float32", "cpu", 0)
    prefill = [stage(r) for r in ([0, 1, 2], [3, 4], [5, 6, 7])]
    decode = [stage(r) for r in ([0, 1, 2, 3, 4], [5, 6, 7])]
    for d in decode:
        covered = [g for s in prefill for g in plan(s, d, [0], 0, [1], 1).layers]
        assert sorted(covered) == sorted(d.layers)


@pytest.mark.parametrize("args,needle", [
    (([2, 99], 0, [1, 2], 0), "source block id 99"),
    (([2], 0, [1, 2], 0), "differ in length"),
    (([2], 5, [1], 0), "source slot id 5"),
    (([2], 0, [1], None), "destination slot ids must be integers"),
    (([2], 0, [-1], 0), "destination block id -1"),
])
def test_bad_ids_are_refused_with_the_value(args, needle):
    with pytest.raises(TransferError, match=needle):
        plan(SRC, DST, *args)


def test_mismatched_bytes_and_dtype_are_named():
    other = replace(DST, kv=replace(DST.kv, block_bytes=0x80))
    with pytest.raises(TransferError, match="kv.block_bytes"):
        plan(SRC, other, [1], 0, [1], 0)
    with pytest.raises(TransferError, match="dtype"):
        plan(SRC, replace(DST, dtype="bfloat16"), [1], 0, [1], 0)
    conv = replace(DST.state.tensors[0], section_bytes=(0x40, 0x60, 0x60))
    with pytest.raises(TransferError, match="state.conv.section_bytes"):
        plan(SRC, replace(DST, state=replace(DST.state, tensors=(conv, DST.state.tensors[1]))),
             [1], 0, [1], 0)
    with pytest.raises(TransferError, match=r"state tensors differ: source \['conv', 'ssm'\]"):
        plan(SRC, replace(DST, state=replace(DST.state, tensors=DST.state.tensors[::-1])),
             [1], 0, [1], 0)


def test_coalesce_vectorised_merges_runs():
    src = np.array([0, 10, 20, 100], dtype=np.uint64)
    dst = np.array([50, 60, 70, 80], dtype=np.uint64)
    s, d = coalesce(src, dst, np.full(4, 10, dtype=np.uint64))
    assert rows(s) == [(0, 30), (100, 10)] and rows(d) == [(50, 30), (80, 10)]


def test_snapshot_slots_move_16_bit_state_between_snapshot_pools():
    """A real split pool (docs/state-precision.md): the layout registers the snapshot pool
    as units of their own (bf16) size after the live ones; a slot id past the live slots
    plans snapshot pool to snapshot pool, at half the bytes; live to snapshot is refused."""
    import torch

    from baton.model.pools import Pools, PoolSpec
    from tests.unit.cache.test_cache_manager import MODEL, TPB

    spec = PoolSpec.for_model(MODEL, num_blocks=4, tokens_per_block=TPB, num_slots=5)
    split = spec.split_snapshots(2, {t.name: torch.bfloat16 for t in spec.state_tensors})
    a, b = Pools(split), Pools(split)
    la, lb = StageLayout.from_pools(a), StageLayout.from_wire(StageLayout.from_pools(b).to_wire())
    assert (la.state.num_slots, la.state.snapshot_slots) == (2, 3)
    assert len(la.unit_table()) == la.num_kv_units + 2 * (la.num_state_units
                                                          + la.num_snapshot_units)
    live, snap = plan(la, lb, [0], 1, [1], 0), plan(la, lb, [0], 3, [1], 4)
    kv = int(live.length[:len(la.kv.layers)].sum())  # one block of every KV layer
    assert 2 * (int(snap.nbytes) - kv) == int(live.nbytes) - kv
    assert la.state_slot_bytes(3) * 2 == la.state_slot_bytes(1)
    for p, side, lay in ((snap, "src", la), (snap, "dst", lb)):
        units, addr = getattr(p, f"{side}_units"), getattr(p, f"{side}_addr")
        table = lay.unit_table()
        assert (table[units, 0] == addr).all() and (table[units, 1] == p.length).all()
    # the bytes land where Pools.slot puts them
    n = len(split.state_layers)
    ssm = snap.src_addr[-n:]
    want = [a.snapshots["ssm"][i, 3 - 2].data_ptr() for i in range(n)]
    assert ssm.tolist() == want
    with pytest.raises(TransferError, match="slot bytes differ"):
        plan(la, lb, [0], 1, [1], 4)
    with pytest.raises(TransferError, match="outside the pool"):
        plan(la, lb, [0], 5, [1], 4)
