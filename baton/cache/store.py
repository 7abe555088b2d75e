"""Snapshot storage: eviction-aware allocation of KV blocks and snapshot slots, and the
tensor copies that take a snapshot (live -> snapshot) and restore one (snapshot -> live).

    slots  [ live 0 .. max_live-1 worth | snapshot budget = num_slots - max_live ]
           (ids are not partitioned; only the counts are: snapshots <= budget always,
            so a free slot exists whenever fewer than max_live requests run)
    split  [ live 0 .. num_slots-1 (float32) ][ snapshot num_slots .. (16-bit) ]
           (PoolSpec.snapshot_slots: snapshots take only the second range, stored in the
            narrower dtype; docs/state-precision.md)
"""

from __future__ import annotations

from baton.cache.allocators import BlockAllocator, SlotAllocator
from baton.cache.tree import Node, PrefixTree, Snapshot
from baton.errors import CapacityError
from baton.model.pools import Pools


class SnapshotStore:
    def __init__(self, pools: Pools, tokens_per_block: int, num_slots: int, budget: int,
                 num_blocks: int | None = None):
        """`num_blocks`: the pool's first blocks this store hands out (default all). Pools
        with snapshot-only slots (`PoolSpec.snapshot_slots`, a narrower dtype) give
        snapshots those ids and live requests the first `num_slots`."""
        self.pools = pools
        n = pools.spec.num_blocks if num_blocks is None else num_blocks
        self.blocks = BlockAllocator(n) if pools.has_kv else None
        s = pools.spec
        self.slots = SlotAllocator(num_slots, range(s.num_slots, s.num_slots + s.snapshot_slots)
                                   if pools.has_state else range(0))
        self.tree = PrefixTree(tokens_per_block, self.blocks, self.slots)
        self.budget = budget
        self.taken = 0
        self.restored = 0
        """Snapshots put back into the tree from a tier."""

    def alloc_block(self, required: bool = True) -> int | None:
        """A free block, evicting LRU tree blocks; CapacityError (or None) when impossible."""
        while self.blocks.num_free == 0:
            if not self.tree.evict_block():
                if not required:
                    return None
                raise CapacityError(
                    f"no KV block is free or evictable (cache.num_blocks="
                    f"{self.blocks.num_blocks}, all held by running requests); raise num_blocks"
                )
        return self.blocks.allocate()

    def snapshot_slot(self) -> int | None:
        """A slot within the snapshot budget, dropping LRU snapshots; None if the budget is 0."""
        while self.tree.num_snapshots >= self.budget:
            if not self.tree.evict_snapshot():
                return None
        return self._free_snapshot_id()

    def stage_slot(self) -> int | None:
        """A snapshot-only slot for a handoff's staged state (outside the tree), dropping
        LRU snapshots until one is free; None if every one stages a handoff already."""
        return self._free_snapshot_id()

    def _free_snapshot_id(self) -> int | None:
        s = self.slots.allocate_snapshot()
        while s is None and self.slots.snapshot_ids and self.tree.evict_snapshot():
            s = self.slots.allocate_snapshot()
        return s

    def take(self, node: Node, tail: tuple[int, ...], live_slot: int, tail_block: int | None):
        """Snapshot the live state at `node` (+ `tail` tokens, read from `tail_block`).

        Returns the snapshot (an existing identical one is reused), or None when no slot
        or page can be had: a snapshot is an optimisation, never worth failing for.
        """
        old = node.partial if tail else node.snapshot
        if old is not None and old.tail == tail:
            self.tree.touch(old)
            return old
        slot = self.snapshot_slot()
        if slot is None:
            return None
        page = None
        if tail and self.blocks is not None:
            page = self.alloc_block(required=False)
            if page is None:
                self.slots.release(slot)
                return None
            self.pools.copy_block(tail_block, page)
        self.pools.copy_slot(live_slot, slot)
        self.taken += 1
        if tail:
            return self.tree.add_partial(node, tail, slot, page)
        return self.tree.add_snapshot(node, slot, node.depth * self.tree.tpb)

    def restore(self, snap: Snapshot | None, live_slot: int) -> int | None:
        """Copy `snap`'s state into the live slot (zero it if None); a private copy of a
        partial snapshot's page is returned as a fresh block (None if there is no page)."""
        if snap is None:
            self.pools.zero_slot(live_slot)
            return None
        self.pools.copy_slot(snap.slot, live_slot)
        if snap.page is None:
            return None
        self.tree.pinned = snap  # allocating must not evict the page it is about to copy
        try:
            b = self.alloc_block()
        finally:
            self.tree.pinned = None
        self.pools.copy_block(snap.page, b)
        return b
