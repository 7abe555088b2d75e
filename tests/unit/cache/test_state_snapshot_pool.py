"""Snapshot slots in their own 16-bit pool (`PoolSpec.split_snapshots`,
docs/state-precision.md): snapshots take only those ids and half the bytes; copies narrow and
widen; the disk tier, canaries, integrity and Stats follow."""

from __future__ import annotations

import torch

from baton.cache.canary import CANARY, bad_slots
from baton.cache.manager import HybridCacheManager
from baton.cache.tiers import Tiers
from baton.cache.tiers.entry import Layout
from baton.config.cache import CacheConfig, MambaStateConfig
from baton.model.pools import Pools, PoolSpec
from tests.unit.cache.test_cache_manager import MODEL, TPB
from tests.unit.cache.test_cache_tiers import A, B, C, compute, disk, state_of

BF16 = {"conv": torch.bfloat16, "ssm": torch.bfloat16}


def split_pools(blocks=12, slots=3, live=1) -> Pools:
    spec = PoolSpec.for_model(MODEL, num_blocks=blocks, tokens_per_block=TPB, num_slots=slots)
    return Pools(spec.split_snapshots(live, BF16))


def manager(path=None, slots=3, max_live=1) -> HybridCacheManager:
    cfg = CacheConfig(tokens_per_block=TPB, num_blocks=12, num_state_slots=slots,
                      mamba_state_config=MambaStateConfig(decode_end_snapshot=False))
    p = split_pools(slots=slots, live=max_live)
    tiers = None
    if path is not None:
        layout = Layout(p, "tiny")
        tiers = Tiers(layout, disk(path, 1 << 20, layout))
    return HybridCacheManager(cfg, p, max_live, tiers=tiers)


def test_the_split_holds_snapshots_in_half_the_bytes():
    whole = PoolSpec.for_model(MODEL, num_blocks=12, tokens_per_block=TPB, num_slots=5)
    assert whole.split_snapshots(2, {"conv": torch.float32, "ssm": torch.float32}) is whole
    assert whole.split_snapshots(5, BF16) is whole  # no slot left for snapshots
    s = whole.split_snapshots(2, BF16)
    assert (s.num_slots, s.snapshot_slots, s.snapshot_dtypes) == (2, 3, ("bfloat16",) * 2)
    assert 2 * s.snapshot_bytes_per_slot() == s.state_bytes_per_slot()
    assert s.state_bytes() == 2 * s.state_bytes_per_slot() + 3 * s.snapshot_bytes_per_slot()
    p = Pools(s)
    assert p.state["ssm"].shape[1] == 2 and p.snapshots["ssm"].shape[1] == 3
    assert p.snapshots["ssm"].dtype == torch.bfloat16
    p.state["ssm"][:, 1] = 1.0 + 2 ** -7  # a bf16 value: the round trip keeps it
    p.copy_slot(1, 4)
    p.zero_slot(1)
    p.copy_slot(4, 1)
    assert bool((p.state["ssm"][:, 1] == 1.0 + 2 ** -7).all())


def test_snapshots_take_only_their_pool_and_stats_count_the_bytes():
    m = manager(slots=4, max_live=1)
    assert m.snapshot_budget == 3 and sorted(m.slots.free_ids()) == [0, 1, 2, 3]
    compute(m, "a", A, 10.0)
    compute(m, "b", B, 20.0)
    snaps = [m.tree.match(p, 9).snapshot for p in (A, B)]
    assert all(s.slot >= m.pools.spec.num_slots for s in snaps)
    adm = m.admit("a2", A + [99])  # restored: widened into the float32 live slot
    assert adm.slot == 0 and adm.cached_tokens == 9 and state_of(m, adm.slot) == (10.0, 10.5)
    st = m.stats()
    spec = m.pools.spec
    assert st.slots_total == 4 and st.snapshot_budget == 3
    assert st.state_bytes == spec.state_bytes() and st.state_bytes_per_snapshot == \
        spec.snapshot_bytes_per_slot()
    m.abort("a2")
    m.check_integrity()


def test_evicted_bf16_snapshot_comes_back_from_disk(tmp_path):
    m = manager(tmp_path)
    compute(m, "a", A, 10.0)
    compute(m, "b", B, 20.0)
    compute(m, "c", C, 30.0)  # budget 2: A's snapshot goes to the disk tier
    assert m.tiers.disk.stats.admitted == 1
    assert m.tiers.layout.state_bytes == m.pools.spec.snapshot_bytes_per_slot()
    adm = m.admit("a2", A + [99])
    assert adm.cached_tokens == 9 and state_of(m, adm.slot) == (10.0, 10.5)
    m.abort("a2")
    m.check_integrity()


def test_canaries_cover_the_snapshot_pool():
    p = split_pools(slots=4, live=1)
    for s in range(4):
        p.fill_slot(s, CANARY)
    assert bad_slots(p, [0, 1, 2, 3]) == []
    p.snapshots["conv"][0, 1, 0, 0] = 1.0  # slot 2: the snapshot pool's second slot
    assert bad_slots(p, [0, 1, 2, 3]) == [2]


def test_a_staged_handoff_holds_a_snapshot_slot_until_landed_or_released():
    """`stage` takes a snapshot-pool slot (evicting a snapshot when none is free), `land`
    widens it into the live slot and frees it; a quarantine keeps the staged slot (where a
    late write lands) and frees the live one; integrity accounts for it throughout."""
    m = manager(slots=3, max_live=1)  # live slot 0; snapshot slots 1, 2
    m.admit_remote("r", [1] * (2 * TPB))
    st = m.stage("r")
    assert st in (1, 2) and m.stage("r") == st and m.staged("r") == st
    m.check_integrity()
    m.pools.slot("ssm", st).fill_(1.0 + 2 ** -7)
    m.land("r")
    assert m.staged("r") is None
    assert (m.pools.slot("ssm", m.slot("r")) == 1.0 + 2 ** -7).all()
    m.check_integrity()
    m.abort("r")
    m.check_integrity()
    m.admit_remote("q", [2] * TPB)
    st = m.stage("q")
    m.quarantine("q", [], keep_slot=True)
    assert m.quarantined()["q"][1] == st and m.num_free_slots == 1
    m.check_integrity()
    m.release_quarantine("q")
    m.check_integrity()
    assert sorted(m.free_ids()[1]) == [0, 1, 2]
