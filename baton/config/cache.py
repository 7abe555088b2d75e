"""Cache section of the config: block/slot pool sizes and the snapshot policy.

Validation happens at construction so that a bad YAML file fails at start-up with an
error naming the field (`cache.mamba_state_config.<field>`), never mid-request.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from baton.config.cache_tiers import EvictionConfig, SharedStoreConfig, TierConfig
from baton.contract.types import DEFAULT_TOKENS_PER_BLOCK
from baton.errors import ConfigError

_MSC = "cache.mamba_state_config"
STATE_DTYPES = ("model", "float32", "bfloat16", "float16")
"""Values of cache.state_dtype and of each cache.state_dtypes entry ("model": the pools')."""
STATE_ROUNDINGS = ("nearest", "stochastic")
KV_DTYPES = ("model", "bfloat16", "float8_e4m3")


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
    state_dtype: Literal["model", "float32", "bfloat16", "float16"] = "model"
    """Stored dtype of every declared recurrent state tensor; the update computes in float32
    from the stored state and rounds once when it stores (docs/state-precision.md)."""
    state_dtypes: Mapping[str, str] | tuple[tuple[str, str], ...] = ()
    """{TENSOR: DTYPE}: one state tensor apart from state_dtype (e.g. conv kept in float32);
    given as a mapping, kept as sorted (name, dtype) pairs."""
    state_rounding: Literal["nearest", "stochastic"] = "nearest"
    """How a float32 state is stored in a 16-bit dtype: round to nearest even, or stochastic
    rounding keyed by (seed, token prefix, position, layer, tensor, element), never by slot."""
    state_rounding_seed: int = 0
    """Seed of the stochastic rounding draws (0 <= seed < 2**64); part of the cache format."""
    kv_dtype: Literal["model", "bfloat16", "float8_e4m3"] = "model"
    """Stored dtype of attention KV (float8_e4m3: with a scale per token and KV head)."""

    def __post_init__(self) -> None:
        self._validate_formats()
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

    def _validate_formats(self) -> None:
        """One line per refusal, naming the key, the value and what is allowed."""
        def allowed(key: str, value: object, values: tuple[str, ...]) -> None:
            if value not in values:
                raise ConfigError(f"{key}={value!r} is not supported; allowed: "
                                  f"{', '.join(values)}")

        allowed("cache.state_dtype", self.state_dtype, STATE_DTYPES)
        allowed("cache.state_rounding", self.state_rounding, STATE_ROUNDINGS)
        allowed("cache.kv_dtype", self.kv_dtype, KV_DTYPES)
        pairs = self.state_dtypes
        if isinstance(pairs, Mapping):
            pairs = tuple(pairs.items())
        if not isinstance(pairs, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
                for p in pairs):
            raise ConfigError(f"cache.state_dtypes={self.state_dtypes!r} must map state tensor "
                              "names to dtypes, e.g. {conv: float32, ssm: bfloat16}")
        for name, dt in pairs:
            allowed(f"cache.state_dtypes.{name}", dt, STATE_DTYPES)
        object.__setattr__(self, "state_dtypes", tuple(sorted((n, d) for n, d in pairs)))
        seed = self.state_rounding_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ConfigError(f"cache.state_rounding_seed={seed!r} must be an integer in "
                              "[0, 2**64)")
        if self.state_rounding == "stochastic" and self.state_dtype == "float32" and all(
                d == "float32" for _, d in self.state_dtypes):
            raise ConfigError(
                "cache.state_rounding=stochastic with cache.state_dtype=float32: a float32 "
                "state is stored as computed, nothing rounds; set state_dtype: bfloat16 or "
                "float16, or state_rounding: nearest")

    def state_dtype_of(self, tensor: str) -> str:
        """The configured dtype name of state tensor `tensor` ("model" = the pools')."""
        return dict(self.state_dtypes).get(tensor, self.state_dtype)

    @property
    def cache_format(self) -> str:
        """What the pools store, as the handshake fingerprint compares it: workers whose
        formats differ are refused before a byte moves."""
        parts = [f"state={self.state_dtype}"]
        parts += [f"state.{n}={d}" for n, d in self.state_dtypes]
        parts.append(f"rounding={self.state_rounding}")
        if self.state_rounding == "stochastic":
            parts.append(f"seed={self.state_rounding_seed}")
        parts.append(f"kv={self.kv_dtype}")
        return ";".join(parts)
