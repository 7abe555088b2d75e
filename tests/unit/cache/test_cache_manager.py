"""HybridCacheManager on tiny pools: exact block ids, slot ids, bytes and eviction order.

Pools: tokens_per_block = 4 unless a test says otherwise; ids come off FIFO free queues
(lowest first at start, then in the order they were freed).
"""

from __future__ import annotations

import pytest
import torch

from baton.cache.manager import Admission, HybridCacheManager
from baton.config.cache import CacheConfig, MambaStateConfig
from baton.errors import CapacityError, InvalidRequestError
from baton.model.nemotron_h.config import ModelConfig
from baton.model.pools import Pools, PoolSpec

MODEL = ModelConfig.from_dict(
    dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M*M-", num_attention_heads=2,
         num_key_value_heads=1, head_dim=8, mamba_num_heads=4, mamba_head_dim=4,
         ssm_state_size=4, n_groups=1)
)
TPB = 4


def make(blocks=12, slots=5, max_live=2, interval=0, start=(), end=(0,), decode_end=False,
         layers=None, **kw) -> HybridCacheManager:
    policy = MambaStateConfig(
        periodic_snapshot_interval=interval, additional_snapshot_offsets_from_start=start,
        additional_snapshot_offsets_from_end=end, decode_end_snapshot=decode_end, **kw,
    )
    cfg = CacheConfig(tokens_per_block=TPB, num_blocks=blocks, num_state_slots=slots,
                      mamba_state_config=policy)
    spec = PoolSpec.for_model(MODEL, num_blocks=blocks, tokens_per_block=TPB, num_slots=slots,
                              layers=layers)
    return HybridCacheManager(cfg, Pools(spec), max_live)


def run_prefill(m: HybridCacheManager, rid: str, prompt: list[int], start: int = 0) -> list[bool]:
    """Compute the prompt chunk by chunk, ending at each point; the commits' results."""
    out = []
    for p in m._live[rid].points:
        m.ensure_blocks(rid, p)
        out.append(m.commit(rid, prompt[:p]))
    return out


def serve(m, rid, prompt, generated=(), session=None) -> Admission:
    adm = m.admit(rid, prompt, session)
    run_prefill(m, rid, prompt)
    toks = list(prompt) + list(generated)
    m.ensure_blocks(rid, len(toks))
    m.finish(rid, toks)
    m.check_integrity()
    return adm


def fill_slot(m, slot, value):
    m.pools.conv[:, slot].fill_(value)
    m.pools.ssm[:, slot].fill_(value + 0.5)


def fill_block(m, block, value):
    m.pools.kv[:, block] = value + torch.arange(TPB, dtype=torch.float32).view(1, 1, TPB, 1, 1)


P10 = list(range(1, 11))


def test_first_request_ids_and_commits():
    m = make(interval=4)
    adm = m.admit("a", P10)
    assert adm == Admission(0, [], 0, (4, 8, 10))
    m.ensure_blocks("a", 4)
    assert m.block_table("a") == [0] and m.slot("a") == 0
    assert not m.commit("a", P10[:3])  # not a point: nothing
    assert m.commit("a", P10[:4])
    m.ensure_blocks("a", 10)
    assert m.block_table("a") == [0, 1, 2]
    assert m.commit("a", P10[:8]) and m.commit("a", P10[:10])
    assert not m.commit("a", P10[:10])  # after the last point nothing more is committed
    s = m.stats()
    assert (s.snapshots_taken, s.slots_snapshot, s.partial_snapshots, s.tree_nodes) == (3, 3, 1, 2)
    assert m.tree.root.children[(1, 2, 3, 4)].snapshot.slot == 1
    partial = m.tree.root.children[(1, 2, 3, 4)].children[(5, 6, 7, 8)].partial
    assert (partial.slot, partial.page, partial.tail, partial.num_tokens) == (3, 3, (9, 10), 10)
    m.check_integrity()
    m.finish("a", P10)
    # block 2 (tokens 9-10) is not a tree block: freed; 0, 1 stay in the tree, 3 is the page
    assert m.blocks.free_ids() == [4, 5, 6, 7, 8, 9, 10, 11, 2]
    assert m.slots.free_ids() == [4, 0]
    m.check_integrity()


def test_exact_repeat_reuses_the_previous_snapshot_and_unaligned_share_gets_a_page_copy():
    m = make(interval=4)
    serve(m, "a", P10)
    # an exact repeat may not cover the last token: the partial at 10 is out, 8 is in
    assert m.admit("b", P10) == Admission(8, [0, 1], 4, (10,))
    # a longer prompt reuses the partial snapshot at 10: a private copy of page 3 -> block 4
    assert m.admit("c", P10 + [50, 51]) == Admission(10, [0, 1, 4], 0, (12,))
    assert torch.equal(m.pools.kv[:, 4], m.pools.kv[:, 3])
    m.check_integrity()
    m.abort("b")
    m.abort("c")
    assert m.blocks.ref[4] == 0 and m.blocks.ref[0] == 1
    m.check_integrity()


def test_domain_example_16_token_blocks():
    """Snapshots at 16, 32, 48: share 40 -> reuse 32; exact repeat of 48 -> reuse 32."""
    global TPB
    old, TPB = TPB, 16
    try:
        m = make(blocks=8, interval=16, end=())
        p = list(range(100, 148))
        serve(m, "a", p)
        assert m.admit("b", p).cached_tokens == 32
        assert m.admit("c", p[:40] + [1] * 8).cached_tokens == 32
    finally:
        TPB = old


def test_admission_restores_exactly_the_snapshot_bytes():
    m = make(interval=4)
    m.admit("a", P10)
    m.ensure_blocks("a", 10)
    for b in range(3):
        fill_block(m, b, 10.0 * (b + 1))
    fill_slot(m, 0, 4.0)
    m.commit("a", P10[:4])
    fill_slot(m, 0, 8.0)
    m.commit("a", P10[:8])
    fill_slot(m, 0, 10.0)
    m.commit("a", P10[:10])
    page = m.tree.root.children[(1, 2, 3, 4)].children[(5, 6, 7, 8)].partial.page
    fill_slot(m, 0, -1.0)  # the live state moves on; snapshots must not
    fill_block(m, 2, -1.0)  # the request keeps writing its own last block
    m.finish("a", P10)
    b = m.admit("b", P10[:9] + [60])  # uses the snapshot at 8
    assert b.cached_tokens == 8
    assert torch.all(m.pools.conv[:, b.slot] == 8.0) and torch.all(m.pools.ssm[:, b.slot] == 8.5)
    c = m.admit("c", P10 + [61])  # uses the partial at 10
    assert c.cached_tokens == 10 and c.block_table[:2] == [0, 1]
    assert torch.all(m.pools.conv[:, c.slot] == 10.0) and torch.all(m.pools.ssm[:, c.slot] == 10.5)
    want = 30.0 + torch.arange(TPB, dtype=torch.float32)
    assert torch.equal(m.pools.kv[0, page, 0, :, 0, 0], want)  # copied at commit, before -1
    assert torch.equal(m.pools.kv[0, c.block_table[2], 0, :, 0, 0], want)
    m.check_integrity()


def test_no_match_zeroes_the_live_slot():
    m = make()
    fill_slot(m, 0, 7.0)
    adm = m.admit("a", [9, 9, 9])
    assert adm.slot == 0
    assert torch.all(m.pools.conv[:, 0] == 0) and torch.all(m.pools.ssm[:, 0] == 0)


def test_only_the_latest_partial_per_block_is_kept():
    m = make(end=(0, 1))
    adm = m.admit("a", P10)
    assert adm.snapshot_points == (9, 10)
    m.ensure_blocks("a", 10)
    assert m.commit("a", P10[:9]) and m.commit("a", P10[:10])
    node = m.tree.root.children[(1, 2, 3, 4)].children[(5, 6, 7, 8)]
    assert (node.partial.tail, node.partial.slot, node.partial.page) == ((9, 10), 2, 4)
    assert m.stats().partial_snapshots == 1
    assert m.slots.free_ids() == [3, 4, 1] and m.blocks.ref[3] == 0  # the older one is gone
    m.check_integrity()


def test_snapshot_lru_leaves_tombstones_and_kv_paths_stay_usable():
    m = make(slots=3, interval=4, end=())  # 2 live + 1 snapshot slot
    serve(m, "a", P10[:8])
    node4 = m.tree.root.children[(1, 2, 3, 4)]
    # slot 1 held the snapshot at 4 until the one at 8 needed the only snapshot slot; freed
    # ids queue up behind the never-used ones, so the snapshot at 8 got slot 2
    assert node4.snapshot is None and node4.children[(5, 6, 7, 8)].snapshot.slot == 2
    assert m.stats().snapshots_evicted == 1  # the snapshot at 4 made room for the one at 8
    assert m.admit("b", P10[:4] + [40, 41]).cached_tokens == 0  # tombstone: no state at 4
    assert m.admit("c", P10[:8] + [42]) == Admission(8, [0, 1], 0, ())  # path through it
    m.check_integrity()


def test_kv_eviction_is_lru_over_unlocked_leaves():
    m = make(blocks=6, slots=4, max_live=1)  # 3 snapshot slots
    A, B, C = list(range(1, 9)), list(range(11, 19)), list(range(21, 29))
    for rid, p in (("a", A), ("b", B), ("c", C)):
        serve(m, rid, p)
    assert m.blocks.num_free == 0 and m.can_allocate(6)
    assert m.admit("b2", B + [99]).cached_tokens == 8  # B becomes most recently used
    m.abort("b2")
    D = list(range(31, 39))
    serve(m, "d", D)  # needs 2 blocks: evicts A's leaf then A's root child
    assert set(m.tree.root.children) == {tuple(B[:4]), tuple(C[:4]), tuple(D[:4])}
    assert m.stats().blocks_evicted == 2
    serve(m, "e", list(range(41, 49)))  # next: C, the least recently used
    assert set(m.tree.root.children) == {tuple(B[:4]), tuple(D[:4]), (41, 42, 43, 44)}
    assert m.admit("b3", B + [1]).cached_tokens == 8
    m.check_integrity()


def test_locked_paths_are_never_evicted():
    m = make(blocks=4, slots=4, max_live=2)
    A = list(range(1, 9))
    serve(m, "a", A)
    adm = m.admit("x", A + [50])  # locks A's two blocks
    assert adm == Admission(8, [0, 1], 2, (9,))
    assert m.can_allocate(2) and not m.can_allocate(3)
    with pytest.raises(CapacityError, match=r"needs 3 more KV blocks for 20 tokens"):
        m.ensure_blocks("x", 20)
    assert m.block_table("x") == [0, 1]  # unchanged after the failure
    m.admit("y", [7, 7, 7, 7, 7])
    with pytest.raises(CapacityError, match="needs 3 more KV blocks .* only 2 are free and 0"):
        m.ensure_blocks("y", 9)
    m.ensure_blocks("y", 8)
    assert m.block_table("y") == [2, 3] and m.tree.root.children[tuple(A[:4])].block == 0
    m.check_integrity()


def test_live_slots_capacity_and_request_errors():
    m = make(max_live=2)
    m.admit("a", [1, 2])
    with pytest.raises(InvalidRequestError, match="already admitted"):
        m.admit("a", [1, 2])
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        m.admit("e", [])
    m.admit("b", [3])
    with pytest.raises(CapacityError, match="all 2 live slots are in use"):
        m.admit("c", [4])
    m.abort("a")
    with pytest.raises(KeyError, match="'a' holds no cache"):
        m.abort("a")
    with pytest.raises(KeyError):
        m.finish("zz", [1])
    m.check_integrity()


def test_commit_checks_blocks_and_tokens():
    m = make()
    m.admit("a", P10)
    with pytest.raises(ValueError, match="cover only 0"):
        m.commit("a", P10)
    m.admit("b", P10)
    m.ensure_blocks("b", 10)
    with pytest.raises(ValueError, match="not the prompt's first 10"):
        m.commit("b", [0] * 10)


def test_decode_end_snapshot_covers_prompt_and_answer():
    m = make(decode_end=True)
    p1 = [1, 2, 3, 4, 5, 6]
    assert serve(m, "t0", p1, generated=[7, 8, 9]).snapshot_points == (6,)
    history = p1 + [7, 8, 9]
    adm = serve(m, "t1", history + [10, 11], generated=[12])
    assert adm.cached_tokens == 9
    assert m.admit("t2", history + [10, 11, 12, 13]).cached_tokens == 12
    m.check_integrity()


def test_per_conversation_keeps_the_last_turns():
    m = make(blocks=16, slots=10, per_conversation=True, max_num_turns=2, end=(),
             decode_end=True)
    history, cached = [], []
    for t in range(4):  # each turn: 3 new prompt tokens, 3 generated (boundaries in new blocks)
        p = history + [20 + t, 30 + t, 40 + t]
        adm = serve(m, f"t{t}", p, generated=[50 + t, 51, 52], session="s")
        assert adm.snapshot_points == (len(p),)  # only the turn boundary
        cached.append(adm.cached_tokens)
        history = p + [50 + t, 51, 52]
    assert cached == [0, 6, 12, 18]
    # 2 snapshots per turn (prompt end, decode end); t0 retired by t2, t1 by t3
    assert m.stats().snapshots_retired == 4 and m.stats().slots_snapshot == 4
    assert m.admit("old", history[:6] + [99]).cached_tokens == 0  # t0's decode end is gone
    m.abort("old")
    assert m.admit("new", history + [1]).cached_tokens == 24
    assert m.admit("other", history[:12] + [1], session="x").cached_tokens == 0  # t1's too
    m.check_integrity()


def test_admit_remote_shares_full_blocks_only():
    m = make(interval=4)
    serve(m, "a", P10)
    adm = m.admit_remote("r", P10[:9] + [70, 71, 72])  # 12 tokens, blocks 0, 1 shared
    assert adm == Admission(8, [0, 1, 4], 4, ())
    assert m.admit_remote("r2", P10[:8]).block_table == [0, 1]
    m.check_integrity()
    m.finish("r", P10[:9] + [70, 71, 72])  # no decode-end policy: nothing committed
    m.abort("r2")
    assert m.stats().remote_hit_tokens == 16 and m.stats().remote_queried_tokens == 20
    m.check_integrity()


def test_stats_count_queries_and_hits():
    m = make(interval=4)
    serve(m, "a", P10)
    serve(m, "b", P10 + [1, 2])
    s = m.stats()
    assert (s.queried_tokens, s.hit_tokens) == (22, 10)
    assert s.hit_rate == pytest.approx(10 / 22)
    assert (s.blocks_total, s.slots_total, s.snapshot_budget, s.slots_live) == (12, 5, 3, 0)
    assert s.blocks_free + s.blocks_cached == 12


def test_attention_free_stage_has_no_blocks():
    m = make(layers=(0,), interval=4)
    assert not m.pools.has_kv
    serve(m, "a", P10)
    adm = m.admit("b", P10 + [5])
    assert adm == Admission(10, [], 4, (11,))
    assert m.can_allocate(10_000) and m.num_free_blocks == 0
    m.check_integrity()
    m.abort("b")
    while m.tree.evict_snapshot():  # tombstones are useless without KV: pruned at once
        pass
    assert m.tree.num_nodes == 0
    m.check_integrity()


def test_mamba_free_stage_keeps_slot_bookkeeping():
    m = make(layers=(1,), interval=4)
    assert not m.pools.has_state and m.slots.num_slots == 5
    serve(m, "a", P10)
    assert m.admit("b", P10 + [5]) == Admission(10, [0, 1, 4], 4, (11,))
    m.check_integrity()


def test_integrity_names_the_broken_owner():
    m = make(interval=4)
    serve(m, "a", P10)
    m.blocks.ref[0] += 1
    with pytest.raises(AssertionError, match="block 0 has ref count 2 but 1 owners"):
        m.check_integrity()
    m.blocks.ref[0] -= 1
    m.slots._free.append(1)
    with pytest.raises(AssertionError, match="slot 1 is free but owned by the snapshot at 4 "):
        m.check_integrity()


def test_restoring_a_partial_never_evicts_its_own_page():
    m = make(blocks=3, slots=3, max_live=2)  # 1 snapshot slot
    serve(m, "a", [1, 2, 3, 4, 5, 6])  # node (block 0) + partial at 6 (page 2); block 1 freed
    m.admit("c", [9])
    m.ensure_blocks("c", 1)  # takes block 1: nothing free now
    assert m.block_table("c") == [1] and m.num_free_blocks == 0
    with pytest.raises(CapacityError, match="no KV block is free or evictable"):
        m.admit("b", [1, 2, 3, 4, 5, 6, 7])  # would need the partial's page itself
    assert m.stats().partial_snapshots == 1  # the snapshot survived the failed admission
    m.check_integrity()
    m.abort("c")
    assert m.admit("b", [1, 2, 3, 4, 5, 6, 7]) == Admission(6, [0, 1], 0, (7,))
    m.check_integrity()


def test_snapshot_listener_sees_exact_tokens_of_adds_and_drops():
    from baton.cache.manager import HybridCacheManager
    from baton.config.cache import CacheConfig, MambaStateConfig
    from baton.model.nemotron_h.config import ModelConfig
    from baton.model.pools import Pools, PoolSpec

    mcfg = ModelConfig.from_dict(dict(
        vocab_size=64, hidden_size=32, hybrid_override_pattern="M*M-", num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, mamba_num_heads=4, mamba_head_dim=4,
        ssm_state_size=4, n_groups=1,
    ))
    pools = Pools(PoolSpec.for_model(mcfg, num_blocks=16, tokens_per_block=4, num_slots=3))
    cfg = CacheConfig(
        tokens_per_block=4, num_blocks=16, num_state_slots=3,
        mamba_state_config=MambaStateConfig(
            periodic_snapshot_interval=4, additional_snapshot_offsets_from_end=(0,),
            decode_end_snapshot=False,
        ),
    )
    mgr = HybridCacheManager(cfg, pools, max_live=1)
    seen = []
    mgr.set_snapshot_listener(lambda added, toks, n: seen.append((added, toks, n)))
    prompt = list(range(10, 20))  # 10 tokens: points 4, 8, 10
    mgr.admit("a", prompt)
    for end in (4, 8, 10):
        mgr.ensure_blocks("a", end)
        mgr.commit("a", prompt[:end])
    mgr.finish("a", prompt)
    added = [(t, n) for a, t, n in seen if a]
    assert added[:2] == [(prompt[:4], 4), (prompt[:8], 8)]
    # two snapshot slots: the third snapshot evicts the least recently used one
    assert (prompt, 10) in added
    dropped = [(t, n) for a, t, n in seen if not a]
    assert dropped == [(prompt[:4], 4)]
    mgr.check_integrity()


def test_a_snapshot_moves_between_managers_by_hold_and_adopt():
    """Decode side: hold the decode-end snapshot (state in a fresh live slot, blocks locked);
    prefill side: admit_pull the same tokens, the bytes arrive (copied here as a transfer
    would), adopt commits them as its own snapshot; both sides end with nothing held."""
    d, p = make(decode_end=True, slots=6), make(decode_end=True, slots=6)
    history = [1, 2, 3, 4, 5, 6] + [7, 8, 9]  # a turn of 6 prompt tokens, 3 answered
    p.admit("t0", history[:6])  # the prefill worker computed the prompt's first block
    run_prefill(p, "t0", history[:6])
    p.finish("t0", history[:6])
    adm = d.admit("t0", history[:6])
    d.ensure_blocks("t0", 9)
    for b in range(3):
        fill_block(d, b, 10.0 * (b + 1))
    fill_slot(d, adm.slot, 9.0)
    d.finish("t0", history)
    assert d.hold_snapshot("gone", history[:8]) is None and not d.live_requests()
    held = d.hold_snapshot("ship", history)
    assert held.cached_tokens == 9 and len(held.block_table) == 3
    assert torch.all(d.pools.conv[:, held.slot] == 9.0)
    queried = p.stats().remote_queried_tokens
    dst = p.admit_pull("ship", history)
    assert p.stats().remote_queried_tokens == queried  # not a prompt: not counted
    assert dst.cached_tokens == 4 and len(dst.block_table) == 3  # block 0 is held: skipped
    for src, dst_b in zip(held.block_table[1:], dst.block_table[1:], strict=True):
        p.pools.kv[:, dst_b] = d.pools.kv[:, src]
    p.pools.conv[:, dst.slot] = d.pools.conv[:, held.slot]
    p.pools.ssm[:, dst.slot] = d.pools.ssm[:, held.slot]
    d.abort("ship")
    assert p.adopt("ship", history)
    nxt = p.admit("t1", history + [10, 11])
    assert nxt.cached_tokens == 9 and torch.all(p.pools.conv[:, nxt.slot] == 9.0)
    assert torch.equal(p.pools.kv[:, nxt.block_table[1]], d.pools.kv[:, held.block_table[1]])
    p.abort("t1")
    for m in (d, p):
        m.check_integrity()
        assert not m.live_requests()
