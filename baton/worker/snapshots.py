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
        self._held: dict[int, SnapshotEvent] = {}
        self._changes: list[SnapshotEvent] = []
        cache.set_snapshot_listener(self._on_snapshot)

    def _on_snapshot(self, inserted: bool, tokens: list[int], num_tokens: int) -> None:
        k = snapshot_key(tokens, num_tokens, self.tpb)
        ev = SnapshotEvent(inserted, k.block_hash, k.snapshot_hash, num_tokens)
        with self._lock:
            if inserted:
                self._held[k.snapshot_hash] = ev
            else:
                self._held.pop(k.snapshot_hash, None)
            self._changes.append(ev)

    def drain(self, full: bool) -> list[SnapshotEvent]:
        """Changes since the last call; with `full`, every held snapshot as inserted instead."""
        with self._lock:
            self._changes.clear() if full else None
            out = list(self._held.values()) if full else self._changes
            self._changes = []
            return out
