"""Turns the cache manager's snapshot insert/evict notices into router SnapshotEvents."""

from __future__ import annotations

import threading

from baton.proto_gen import baton_pb2
from router.prefix_hash import snapshot_key

INSERTED = baton_pb2.SnapshotEvent.KIND_INSERTED
EVICTED = baton_pb2.SnapshotEvent.KIND_EVICTED


class SnapshotEvents:
    """Keeps the set of snapshots this worker holds and the changes not yet reported."""

    def __init__(self, cache):
        self.tpb = cache.pools.spec.tokens_per_block
        self._lock = threading.Lock()
        self._held: dict[int, baton_pb2.SnapshotEvent] = {}
        self._changes: list[baton_pb2.SnapshotEvent] = []
        cache.set_snapshot_listener(self._on_snapshot)

    def _on_snapshot(self, inserted: bool, tokens: list[int], num_tokens: int) -> None:
        k = snapshot_key(tokens, num_tokens, self.tpb)
        ev = baton_pb2.SnapshotEvent(
            kind=INSERTED if inserted else EVICTED, block_hash=k.block_hash,
            snapshot_hash=k.snapshot_hash, num_tokens=num_tokens,
        )
        with self._lock:
            if inserted:
                self._held[k.snapshot_hash] = ev
            else:
                self._held.pop(k.snapshot_hash, None)
            self._changes.append(ev)

    def drain(self, full: bool) -> list[baton_pb2.SnapshotEvent]:
        """Changes since the last call; with `full`, every held snapshot as inserted instead."""
        with self._lock:
            self._changes.clear() if full else None
            out = list(self._held.values()) if full else self._changes
            self._changes = []
            return out
