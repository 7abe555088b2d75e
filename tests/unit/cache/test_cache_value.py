"""Value-aware eviction (Marconi): FLOPs per layer kind, and the exact order snapshots leave
the pool and the disk tier under `lru` and `value`."""

from __future__ import annotations

import pytest

from baton.cache.manager import HybridCacheManager
from baton.cache.value import Candidate, FlopModel, pick_victim
from baton.config.cache import CacheConfig, MambaStateConfig
from baton.config.cache_tiers import EvictionConfig
from baton.model.nemotron_h.config import ModelConfig
from baton.model.pools import Pools, PoolSpec
from tests.unit.cache.test_cache_manager import MODEL, TPB, serve


def test_flops_per_layer_kind_of_the_test_model():
    """M*M-: hidden 32; Mamba2 4 heads x 4, state 4, 1 group, conv 4; attention 2 heads of 8,
    1 KV head; MLP (relu2, not gated) 21504."""
    f = FlopModel.for_model(MODEL)
    mamba = 2 * 32 * (2 * 16 + 2 * 4 + 4) + 2 * 16 * 32 + 2 * (16 + 8) * 4 + 6 * 16 * 4
    attn = 2 * 32 * (2 + 2) * 8 + 2 * 2 * 8 * 32
    mlp = 2 * 32 * 21504 * 2
    assert (f.linear, f.quadratic) == (2 * mamba + attn + mlp, 2 * 2 * 8)
    assert f.saved(10, 4) == f.linear * 6 + f.quadratic * (100 - 16)


def test_moe_counts_active_experts_only():
    moe = ModelConfig.from_dict(dict(
        vocab_size=64, hidden_size=32, hybrid_override_pattern="E", n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=8,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, mamba_num_heads=4,
        mamba_head_dim=4, ssm_state_size=4, n_groups=1))
    f = FlopModel.for_model(moe)
    assert f.linear == 2 * 32 * 8 + 2 * 4 * 32 * 16 + 4 * 32 * 8 and f.quadratic == 0


def test_pick_victim_lru_and_value():
    # unit, FLOPs saved, bytes, last use
    cands = [Candidate("old-dense", 900.0, 100, 1), Candidate("mid-thin", 100.0, 100, 5),
             Candidate("new-dense", 800.0, 100, 9)]
    assert pick_victim(cands, 10, EvictionConfig("lru")) == "old-dense"
    # value: efficiency norm (1, 0, 0.875) + recency norm (0, 0.0278, 1)
    assert pick_victim(cands, 10, EvictionConfig("value", alpha=1.0)) == "mid-thin"
    assert pick_victim(cands, 10, EvictionConfig("value", alpha=0.0)) == "old-dense"
    assert pick_victim([], 10, EvictionConfig("value")) is None


def make(policy: str, alpha: float = 1.0) -> HybridCacheManager:
    """Snapshot budget 3 (slots 4, one live), plenty of blocks: only slots evict."""
    cfg = CacheConfig(tokens_per_block=TPB, num_blocks=64, num_state_slots=4,
                      mamba_state_config=MambaStateConfig(decode_end_snapshot=False),
                      eviction=EvictionConfig(policy, alpha))
    spec = PoolSpec.for_model(MODEL, num_blocks=64, tokens_per_block=TPB, num_slots=4)
    return HybridCacheManager(cfg, Pools(spec), 1, flops=FlopModel.for_model(MODEL))


def prompt(first: int, n: int) -> list[int]:
    return [first] + [7] * (n - 1)


def held(m) -> list[int]:
    return sorted(s.num_tokens for s in m.tree.lru_units()[1])


@pytest.mark.parametrize("policy, alpha, order", [
    # 16 tokens first (oldest), then 4, then 8; then 12 and 20 need slots
    ("lru", 1.0, [[4, 8, 12], [8, 12, 20]]),
    ("value", 1.0, [[8, 12, 16], [12, 16, 20]]),   # the 4-token one saves least per byte
    ("value", 0.0, [[4, 8, 12], [8, 12, 20]]),     # alpha 0: recency alone, as LRU
    ("value", 50.0, [[8, 12, 16], [12, 16, 20]]),
])
def test_exact_eviction_order_of_the_pool(policy, alpha, order):
    m = make(policy, alpha)
    for i, n in enumerate((16, 4, 8)):
        serve(m, f"r{i}", prompt(10 + i, n))
    assert held(m) == [4, 8, 16]
    serve(m, "r3", prompt(20, 12))
    assert held(m) == order[0]
    serve(m, "r4", prompt(21, 20))
    assert held(m) == order[1]
    m.check_integrity()


def test_a_hit_refreshes_recency_under_value():
    m = make("value", alpha=0.5)
    for i, n in enumerate((16, 4, 8)):
        serve(m, f"r{i}", prompt(10 + i, n))
    adm = m.admit("hit", prompt(11, 4) + [1])  # the 4-token snapshot is used again
    assert adm.cached_tokens == 4
    m.abort("hit")
    serve(m, "r3", prompt(20, 12))
    # without the hit 4 goes (test above); with it, 4 is the most recent (0.5 * 0 + 1) and
    # 16 the least (0.5 * 1 + 0): 16 goes
    assert held(m) == [4, 8, 12]
    m.check_integrity()


@pytest.mark.parametrize("policy, kept", [("lru", ["b", "c"]), ("value", ["a", "c"])])
def test_exact_eviction_order_of_the_disk_tier(tmp_path, policy, kept):
    from baton.cache.tiers.disk import DiskTier
    from baton.cache.tiers.entry import Layout
    from baton.cache.tiers.fileio import FileIO

    pools = Pools(PoolSpec.for_model(MODEL, num_blocks=8, tokens_per_block=TPB, num_slots=2))
    layout = Layout(pools, "m")
    clock = iter(range(1, 100))
    size = layout.entry_bytes(8)
    # value, alpha 2: a = 2 * 1 + 0 (old, dense), b = 2 * 0 + 1 (new, thin): b goes
    t = DiskTier(str(tmp_path), 2 * size, layout, FileIO(), EvictionConfig(policy, alpha=2.0),
                 lambda: next(clock))
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    names = {}
    for i, (name, flops) in enumerate((("a", 9e9), ("b", 1e3), ("c", 5e9))):
        h, pay = layout.gather(toks, [0, 1], 0, flops)
        names[name] = t.key(i)
        assert t.put(names[name], h, pay)
    assert t.stats.evicted == 1
    assert sorted(n for n, k in names.items() if t.has(k)) == kept


def test_branch_point_snapshot_where_a_prompt_leaves_the_cached_kv():
    """Marconi's admission: a second prompt sharing 2 blocks (8 tokens) of a first one whose
    snapshot is at its end (12) gets a snapshot point at 8, where it branches off; a third
    sharing those 8 tokens then restores them."""
    cfg = CacheConfig(tokens_per_block=TPB, num_blocks=64, num_state_slots=6,
                      mamba_state_config=MambaStateConfig(decode_end_snapshot=False,
                                                          branch_point_snapshot=True))
    spec = PoolSpec.for_model(MODEL, num_blocks=64, tokens_per_block=TPB, num_slots=6)
    m = HybridCacheManager(cfg, Pools(spec), 1)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    assert serve(m, "a", shared + [1, 2, 3, 4]).snapshot_points == (12,)
    assert serve(m, "b", shared + [20, 21, 22]).snapshot_points == (8, 11)
    adm = serve(m, "c", shared + [30, 31])
    assert adm.cached_tokens == 8 and adm.snapshot_points == (10,)
    off = CacheConfig(tokens_per_block=TPB, num_blocks=64, num_state_slots=6,
                      mamba_state_config=MambaStateConfig(decode_end_snapshot=False))
    m2 = HybridCacheManager(off, Pools(spec), 1)
    serve(m2, "a", shared + [1, 2, 3, 4])
    assert serve(m2, "b", shared + [20, 21, 22]).snapshot_points == (11,)


def test_alpha_tuner_takes_the_alpha_whose_shadow_saved_most():
    """Budget 2: a 40-token prompt comes back every third request between one-off 4-token
    prompts. Recency alone (alpha 0) evicts it each time; alpha 4 keeps it (it saves ten
    times more per slot): after a window of 10 the tuner moves to 4."""
    from baton.cache.value import AlphaTuner

    t = AlphaTuner(FlopModel(1.0, 0.0), TPB, 2, EvictionConfig("value", 0.0, tune_alpha=True),
                   alphas=(0.0, 4.0), window=10)
    a = list(range(1, 41))
    seq = []
    for i in range(3):
        seq += [(a + [0], [40]), ([100 + 2 * i] * 4 + [0], [4]), ([101 + 2 * i] * 4 + [0], [4])]
    seq.append((a + [0], [40]))
    for p, pts in seq[:-1]:
        t.observe(p, pts)
    assert t.alpha == 0.0 and t.changes == 0
    t.observe(*seq[-1])
    assert t.alpha == 4.0 and t.changes == 1
    got = {sh.cfg.alpha: sum(r) for sh, r in zip(t.shadows, t._recent, strict=True)}
    assert got == {0.0: 0.0, 4.0: 3 * 40.0}


def test_tune_alpha_is_the_managers_eviction_config():
    cfg = CacheConfig(tokens_per_block=TPB, num_blocks=64, num_state_slots=4,
                      mamba_state_config=MambaStateConfig(decode_end_snapshot=False),
                      eviction=EvictionConfig("value", 0.5, tune_alpha=True))
    spec = PoolSpec.for_model(MODEL, num_blocks=64, tokens_per_block=TPB, num_slots=4)
    m = HybridCacheManager(cfg, Pools(spec), 1, flops=FlopModel.for_model(MODEL))
    assert m.tuner is not None and m.eviction_now() is m.tuner.cfg and m.tuner.alpha == 0.5
    assert m.tuner.shadows[0].budget == m.snapshot_budget == 3
    serve(m, "r0", prompt(10, 16))
    assert m.tuner.seen == 1
    m.check_integrity()
