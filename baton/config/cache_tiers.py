"""Config of the snapshot cache's tiers beyond the pool (`cache.tier`, `cache.shared_store`) and
of its eviction policy (`cache.eviction`). See docs/cache-tiers.md.

Only the shape of each value is checked here; whether a path is writable or a store answers
is checked once when the worker starts (`baton.cache.tiers.build`), in one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from baton.errors import ConfigError


@dataclass(frozen=True)
class TierConfig:
    path: str = ""
    """Folder of this host's disk tier ("" = no disk tier). Workers given the same folder
    share its entries (content-addressed, written then committed; never overwritten)."""
    bytes: int = 0
    """Bytes the disk tier may hold; past that the least valuable entries are removed."""
    io: Literal["nixl", "file"] = "nixl"
    """How entries move between memory and the files: NIXL's POSIX backend, or plain file
    I/O (the same bytes; for hosts whose NIXL has no POSIX plugin)."""

    def __post_init__(self) -> None:
        if self.bytes < 0:
            raise ConfigError(f"cache.tier.bytes={self.bytes} must be >= 0")
        if self.path and not self.bytes:
            raise ConfigError(
                f"cache.tier.path={self.path!r} is set but cache.tier.bytes is 0; give the "
                "tier a size in bytes (e.g. 10000000000) or remove cache.tier.path"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.path)


@dataclass(frozen=True)
class SharedStoreConfig:
    url: str = ""
    """redis://HOST:PORT/DB of a store shared by every worker ("" = none). Its password is
    derived from the cluster secret (`baton.cache.tiers.shared.store_password`) unless the
    URL carries one; bound it with the server's own `maxmemory` and eviction policy."""
    timeout_s: float = 0.5
    """Per-call socket timeout: a store that does not answer in time is a miss."""
    max_entry_bytes: int = 64 << 20
    """Entries larger than this are not written to the shared store."""

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("redis://", "rediss://")):
            raise ConfigError(
                f"cache.shared_store.url={self.url!r} must start with redis:// or rediss:// "
                "(redis://HOST:PORT/DB)"
            )
        if self.timeout_s <= 0:
            raise ConfigError(f"cache.shared_store.timeout_s={self.timeout_s} must be > 0")

    @property
    def enabled(self) -> bool:
        return bool(self.url)


@dataclass(frozen=True)
class EvictionConfig:
    policy: Literal["lru", "value"] = "lru"
    """`lru`: least recently used first. `value` (Marconi): lowest score first, score =
    alpha * norm(FLOPs saved per byte) + norm(recency), both min-max normalised."""
    alpha: float = 1.0
    """Weight of FLOP efficiency against recency in the `value` score."""
    tune_alpha: bool = False
    """`value` only: retune alpha online (Marconi): shadows of the pool's snapshot slots,
    one per candidate alpha, see every admitted prompt; every 32 admissions the pool takes
    the alpha whose shadow saved the most prefill FLOPs over the last 32 (`alpha` first)."""

    def __post_init__(self) -> None:
        if self.alpha < 0:
            raise ConfigError(f"cache.eviction.alpha={self.alpha} must be >= 0")
