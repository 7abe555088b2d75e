"""Cache section of the config: block/slot pool sizes and the snapshot policy.

Validation happens at construction so that a bad YAML file fails at start-up with an
error naming the field (`cache.mamba_state_config.<field>`), never mid-request.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from baton.config.cache_tiers import EvictionConfig, SharedStoreConfig, TierConfig
from baton.contract.types import DEFAULT_TOKENS_PER_BLOCK
from baton.errors import ConfigError

_MSC = "cache.mamba_state_config"


@dataclass(frozen=True)
class MambaStateConfig:
    periodic_snapshot_interval: int = 0
    """Snapshot every N prompt tokens (0 = off); must be a multiple of tokens_per_block."""
    additional_snapshot_offsets_from_start: tuple[int, ...] = ()
    """Snapshot after exactly these prompt positions (each > 0)."""
    additional_snapshot_offsets_from_end: tuple[int, ...] = (0,)
    """Snapshot at L - o for each o >= 0 (0 = the final prompt boundary)."""
    decode_end_snapshot: bool = True
    """Snapshot the state after the last generated token, for the next chat turn."""
    per_conversation: bool = False
    """Turn boundaries only (periodic off); keep the last `max_num_turns` turns of a session.
    The boundaries are the end of each prompt and, with decode_end_snapshot, the decode end."""
    max_num_turns: int = 0
    """Turns of one session whose snapshots are kept (per_conversation only; 0 = no limit)."""
    branch_point_snapshot: bool = False
    """Also snapshot where a prompt leaves the KV the pool already holds (the deepest cached
    full block past the restored snapshot): the point later prompts sharing that prefix
    branch from (Marconi's admission). Not with per_conversation."""
    mamba_state_cache_interval: int | None = None
    """Deprecated alias of periodic_snapshot_interval (warns, then reads as None)."""

    def __post_init__(self) -> None:
        _set = object.__setattr__
        _set(self, "additional_snapshot_offsets_from_start",
             tuple(self.additional_snapshot_offsets_from_start))
        _set(self, "additional_snapshot_offsets_from_end",
             tuple(self.additional_snapshot_offsets_from_end))
        if self.mamba_state_cache_interval is not None:
            if self.periodic_snapshot_interval:
                raise ConfigError(
                    f"{_MSC}: both mamba_state_cache_interval={self.mamba_state_cache_interval} "
                    f"(deprecated) and periodic_snapshot_interval="
                    f"{self.periodic_snapshot_interval} are set; keep only "
                    "periodic_snapshot_interval"
                )
            warnings.warn(
                f"{_MSC}.mamba_state_cache_interval is deprecated; use "
                f"periodic_snapshot_interval: {self.mamba_state_cache_interval}",
                FutureWarning,
                stacklevel=3,
            )
            _set(self, "periodic_snapshot_interval", self.mamba_state_cache_interval)
            _set(self, "mamba_state_cache_interval", None)
        self._validate()

    def _validate(self) -> None:
        if self.periodic_snapshot_interval < 0:
            raise ConfigError(
                f"{_MSC}.periodic_snapshot_interval={self.periodic_snapshot_interval} is "
                "negative; use 0 (off) or a positive multiple of cache.tokens_per_block"
            )
        for i, o in enumerate(self.additional_snapshot_offsets_from_start):
            if o <= 0:
                raise ConfigError(
                    f"{_MSC}.additional_snapshot_offsets_from_start[{i}]={o} must be > 0 "
                    "(a snapshot after zero tokens holds nothing)"
                )
        for i, o in enumerate(self.additional_snapshot_offsets_from_end):
            if o < 0:
                raise ConfigError(
                    f"{_MSC}.additional_snapshot_offsets_from_end[{i}]={o} must be >= 0 "
                    "(0 is the final prompt boundary)"
                )
        if self.max_num_turns < 0:
            raise ConfigError(
                f"{_MSC}.max_num_turns={self.max_num_turns} must be >= 0 (0 = no limit)"
            )
        if self.per_conversation and self.periodic_snapshot_interval:
            raise ConfigError(
                f"{_MSC}.periodic_snapshot_interval={self.periodic_snapshot_interval} must be 0 "
                "when per_conversation is true (only turn boundaries are snapshotted)"
            )
        if self.max_num_turns and not self.per_conversation:
            raise ConfigError(
                f"{_MSC}.max_num_turns={self.max_num_turns} only applies with "
                "per_conversation: true; set per_conversation or remove max_num_turns"
            )

    @property
    def has_policy(self) -> bool:
        """Whether any snapshot would ever be taken."""
        return bool(
            self.periodic_snapshot_interval
            or self.additional_snapshot_offsets_from_start
            or self.additional_snapshot_offsets_from_end
            or self.decode_end_snapshot
            or self.per_conversation
        )


@dataclass(frozen=True)
class CacheConfig:
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    """Tokens per paged KV block."""
    num_blocks: int = 2048
    """KV blocks per attention layer, allocated at start."""
    num_state_slots: int = 128
    """Mamba state slots per Mamba layer (live + snapshot), allocated at start. One live slot
    per running request is reserved; the rest (num_state_slots - max_num_seqs) hold snapshots.
    With speculative decoding each running request also holds K more (the state after each
    verified position): max_num_seqs x (1 + K) slots are reserved, the rest hold snapshots."""
    enable_prefix_reuse: bool = True
    """Reuse cached prefixes (KV blocks + a Mamba snapshot). Turned off, with a warning, when
    mamba_state_config has no snapshot policy at all."""
    mamba_state_config: MambaStateConfig = field(default_factory=MambaStateConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    """Disk tier of evicted snapshots (KV + state as one entry); docs/cache-tiers.md."""
    shared_store: SharedStoreConfig = field(default_factory=SharedStoreConfig)
    """Store shared by every worker (Redis); docs/cache-tiers.md."""
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    """Which snapshot leaves the pool (and a tier) first: `lru` or `value` (Marconi)."""

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "num_blocks", "num_state_slots"):
            if getattr(self, name) < 1:
                raise ConfigError(f"cache.{name}={getattr(self, name)} must be >= 1")
        mc, tpb = self.mamba_state_config, self.tokens_per_block
        if mc.periodic_snapshot_interval % tpb:
            lo = mc.periodic_snapshot_interval // tpb * tpb
            raise ConfigError(
                f"{_MSC}.periodic_snapshot_interval={mc.periodic_snapshot_interval} is not a "
                f"multiple of cache.tokens_per_block={tpb}; use {lo or tpb} or {lo + tpb}"
            )
        if self.enable_prefix_reuse and not mc.has_policy:
            warnings.warn(
                "cache.enable_prefix_reuse is true but cache.mamba_state_config has no snapshot "
                "policy (no periodic interval, no offsets, no decode-end snapshot): a hybrid "
                "model cannot reuse a prefix without a Mamba snapshot, so reuse is disabled",
                UserWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "enable_prefix_reuse", False)
