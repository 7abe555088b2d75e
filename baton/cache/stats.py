"""Counters and pool usage of one cache manager (`HybridCacheManager.stats()`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheStats:
    queried_tokens: int
    """Prompt tokens looked up by `admit`."""
    hit_tokens: int
    """Of those, tokens restored from the cache (KV + state snapshot)."""
    remote_queried_tokens: int
    """Prompt tokens looked up by `admit_remote` (decode side, KV only)."""
    remote_hit_tokens: int
    snapshots_taken: int
    """State copies live -> snapshot slot (a commit at an existing snapshot copies nothing)."""
    snapshots_evicted: int
    """Snapshots dropped for room (slot or KV pressure)."""
    snapshots_retired: int
    """Snapshots dropped because their session has more than `max_num_turns` newer turns."""
    blocks_evicted: int
    """KV blocks freed by evicting tree nodes or partial pages."""
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    """Blocks the prefix tree references (nodes and partial pages)."""
    blocks_evictable: int
    slots_total: int
    slots_live: int
    slots_snapshot: int
    snapshot_budget: int
    """Slots snapshots may use: num_state_slots - max_live."""
    tree_nodes: int
    partial_snapshots: int
    blocks_quarantined: int = 0
    """KV blocks of failed transfers kept out of service until no late byte can land there."""
    slots_quarantined: int = 0
    quarantined_total: int = 0
    """Failed reservations ever quarantined."""
    slots_speculative: int = 0
    """Slots kept for speculative decoding's per-position states (max_num_seqs x K), outside
    slots_total."""
    state_bytes: int = 0
    """Bytes of every state slot, live and snapshot (snapshot slots in their stored dtype,
    docs/state-precision.md)."""
    state_bytes_per_snapshot: int = 0
    """Bytes one snapshot's state holds (every layer and tensor, stored dtype)."""
    tier_hit_tokens: int = 0
    """Of hit_tokens, those whose snapshot came back from a tier (disk or shared store)."""
    tiers: dict = field(default_factory=dict)
    """Per tier ("disk", "shared"): its counters (baton/cache/tiers/stats.py)."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
