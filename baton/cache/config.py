"""Cache section of the config: block/slot pool sizes and the snapshot policy."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MambaStateConfig:
    periodic_snapshot_interval: int = 0
    """Snapshot every N prompt tokens (0 = off); must be a multiple of tokens_per_block."""
    additional_snapshot_offsets_from_start: tuple[int, ...] = ()
    """Snapshot after exactly these prompt positions (each > 0)."""
    additional_snapshot_offsets_from_end: tuple[int, ...] = (0,)
    """Snapshot at L - o for each o (0 = the final prompt boundary)."""
    decode_end_snapshot: bool = True
    """Snapshot the state after the last generated token, for the next chat turn."""
    per_conversation: bool = False
    """Turn boundaries only (periodic off); keep the last `max_num_turns` turns of a session."""
    max_num_turns: int = 0
    mamba_state_cache_interval: int | None = None
    """Deprecated alias of periodic_snapshot_interval (warns)."""


@dataclass(frozen=True)
class CacheConfig:
    tokens_per_block: int = 16
    """Tokens per paged KV block."""
    num_blocks: int = 2048
    """KV blocks per attention layer, allocated at start."""
    num_state_slots: int = 64
    """Mamba state slots per Mamba layer (live + snapshot), allocated at start."""
    enable_prefix_reuse: bool = True
    mamba_state_config: MambaStateConfig = field(default_factory=MambaStateConfig)
