"""Turns the cache manager's snapshot insert/evict notices into router SnapshotEvents."""

from __future__ import annotations

import threading

from baton.contract import SnapshotEvent
from baton.contract.prefix_hash import snapshot_key


class SnapshotEvents:
    """Keeps the set of snapshots this worker holds and the changes not yet reported."""

    def __init__(self, cache):
        self.tpb = cache.pools.spec.tokens_per_block
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], SnapshotEvent] = {}
        self._changes: list[SnapshotEvent] = []
        cache.set_snapshot_listener(self._on_snapshot)
        disk = cache.tiers.disk if getattr(cache, "tiers", None) is not None else None
        if disk is not None:  # entries of the disk tier: tier 1 (router counts them lower)
            for bh, sh, n in disk.entries():
                self._record(SnapshotEvent(True, bh, sh, n, 1))
            disk.listener = lambda added, bh, sh, n: self._record(
                SnapshotEvent(added, bh, sh, n, 1))

    def _on_snapshot(self, inserted: bool, tokens: list[int], num_tokens: int) -> None:
        k = snapshot_key(tokens, num_tokens, self.tpb)
        self._record(SnapshotEvent(inserted, k.block_hash, k.snapshot_hash, num_tokens))

    def _record(self, ev: SnapshotEvent) -> None:
        with self._lock:
            if ev.inserted:
                self._held[ev.snapshot_hash, ev.tier] = ev
            else:
                self._held.pop((ev.snapshot_hash, ev.tier), None)
            self._changes.append(ev)

    def drain(self, full: bool) -> list[SnapshotEvent]:
        """Changes since the last call; with `full`, every held snapshot as inserted instead."""
        with self._lock:
            self._changes.clear() if full else None
            out = list(self._held.values()) if full else self._changes
            self._changes = []
            return out
