"""Tiers of the snapshot cache beyond the pool: a disk tier per host and a shared store.

    entry.py    one entry's bytes: header + tokens + whole-path KV + state, checksummed
    fileio.py   payload <-> file through NIXL's POSIX backend (or plain pread/pwrite)
    disk.py     the disk tier (cache.tier): write, fsync, link to commit; scan on start
    shared.py   the shared tier (cache.shared_store: Redis)
    chain.py    the tiers in order: spill on eviction, deepest checked entry on admission
    background.py  the I/O thread: writes and restore reads off the engine thread
    restore.py  entries <-> the pool's prefix tree
    stats.py    per-tier counters

docs/cache-tiers.md has the user's view.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from pathlib import Path

from baton.cache.tiers.chain import Tiers
from baton.cache.tiers.entry import Layout
from baton.config.cache import CacheConfig
from baton.errors import ConfigError

log = logging.getLogger("baton.cache.tiers")

__all__ = ["Tiers", "open_tiers", "model_identity", "refuse_tiers"]


def wanted(cfg: CacheConfig) -> bool:
    return cfg.tier.enabled or cfg.shared_store.enabled


def open_tiers(cfg: CacheConfig, pools, model_id: str, token: str = "",
               background: bool = True) -> Tiers | None:
    """The configured tiers of a one-stage worker (None when none is configured); ConfigError
    in one line for a path or store that cannot serve. `background`: writes and restore
    reads on the tiers' I/O thread (chain.py)."""
    if not wanted(cfg):
        return None
    if not cfg.enable_prefix_reuse:
        log.warning("cache.tier / cache.shared_store are set but prefix reuse is off: unused")
        return None
    from baton.auth.secret import ClusterSecret
    from baton.cache.tiers.disk import DiskTier
    from baton.cache.tiers.fileio import open_io
    from baton.cache.tiers.shared import SharedTier

    layout = Layout(pools, model_id, ClusterSecret(token).key("cache-tier") if token else b"")
    counter = itertools.count(1)
    disk = shared = None
    if cfg.tier.enabled:
        disk = DiskTier(cfg.tier.path, cfg.tier.bytes, layout, open_io(cfg.tier.io),
                        cfg.eviction, lambda: next(counter))
    if cfg.shared_store.enabled:
        shared = SharedTier(cfg.shared_store, layout, token)
    return Tiers(layout, disk, shared, background=background)


def refuse_tiers(cfg, why: str) -> None:
    """Workers split over stages or ranks do not have tiers yet: say so in one line."""
    if wanted(cfg.cache):
        raise ConfigError(
            f"cache.tier / cache.shared_store are not supported with {why} yet; remove them "
            "or run one stage per worker")


def model_identity(path: str | Path) -> str:
    """Names the model in tier entries: its config.json and, per weight file, name, size and
    first and last MiB (cheap, and tells fine-tunes of one architecture apart)."""
    p = Path(path)
    h = hashlib.blake2b(digest_size=16)
    cfg = p / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(size - (1 << 20), 0))
            h.update(fh.read(1 << 20))
    return h.hexdigest()
