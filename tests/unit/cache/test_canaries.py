"""Test canaries in free memory: armed, every free KV block and state slot holds CANARY
(written at start and whenever one is freed, mirrored to other pipeline stages), and the
audit names exactly the free blocks and slots a stray write touched."""

from __future__ import annotations

import torch

from baton.cache.canary import CANARY, bad_blocks, bad_slots
from baton.engine.pipeline.mirror import MirroredPools, apply_ops
from baton.model.pools import Pools
from tests.unit.cache.test_cache_manager import make, run_prefill


def test_armed_manager_keeps_canaries_in_exactly_the_free_blocks_and_slots():
    m = make(blocks=12, slots=5, max_live=2)
    m.arm_canaries()
    blocks, slots = m.free_ids()
    assert blocks == list(range(12)) and slots == list(range(5))
    assert bad_blocks(m.pools, blocks) == [] and bad_slots(m.pools, slots) == []
    # a request takes blocks 0-2 and slot 0 and writes them; while held they are not free
    adm = m.admit("a", list(range(10)))
    m.ensure_blocks("a", 10)
    table, slot = m.block_table("a"), m.slot("a")
    assert table == [0, 1, 2] and slot == 0
    m.pools.kv[:, table].normal_()
    m.pools.conv[:, slot].normal_()
    blocks, slots = m.free_ids()
    assert set(table).isdisjoint(blocks) and slot not in slots
    assert bad_blocks(m.pools, blocks) == [] and bad_slots(m.pools, slots) == []
    # aborted (nothing committed): its blocks and slot are free again and hold canaries again
    assert adm.cached_tokens == 0
    m.abort("a")
    blocks, slots = m.free_ids()
    assert set(table) <= set(blocks) and slot in slots
    assert bad_blocks(m.pools, blocks) == [] and bad_slots(m.pools, slots) == []
    # a stray write into free block 7 (one byte's worth) and free slot 3 is named exactly
    m.pools.kv[0, 7, 1, 2, 0, 3] = 1.0
    m.pools.ssm[0, 3, 0, 0, 1] = 0.0
    assert bad_blocks(m.pools, m.free_ids()[0]) == [7]
    assert bad_slots(m.pools, m.free_ids()[1]) == [3]


def test_blocks_kept_by_the_prefix_tree_are_not_refilled():
    m = make(blocks=12, slots=5, max_live=2)
    m.arm_canaries()
    prompt = list(range(9))
    m.admit("a", prompt)
    run_prefill(m, "a", prompt)
    table = m.block_table("a")
    m.pools.kv[:, table].normal_()  # the request's KV (3 blocks: 4 + 4 + 1 tokens)
    written = m.pools.kv.clone()
    m.finish("a", prompt)
    blocks, _ = m.free_ids()
    kept = sorted(set(range(12)) - set(blocks))
    assert m.stats().blocks_cached == len(kept) and set(table[:2]) <= set(kept)
    assert bad_blocks(m.pools, blocks) == []  # the freed tail block holds canaries again
    for b in table[:2]:  # the tree's full blocks keep their bytes
        assert torch.equal(m.pools.kv[:, b], written[:, b])


def test_canary_fills_are_mirrored_to_the_other_stages():
    whole = make(blocks=6, slots=3, max_live=2).pools
    stage0 = MirroredPools(whole.spec, Pools(whole.spec))
    stage1 = Pools(whole.spec)
    stage0.fill_block(4, CANARY)
    stage0.fill_slot(2, CANARY)
    apply_ops(stage1, stage0.take_ops())
    assert bad_blocks(stage1, [4]) == [] and bad_blocks(stage1, [3]) == [3]
    assert bad_slots(stage1, [2]) == [] and bad_slots(stage1, [1]) == [1]
