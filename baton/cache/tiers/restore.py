"""Between the pool's prefix tree and the tiers: a snapshot leaving the pool becomes an entry;
an entry found for a prompt goes back into the tree as a snapshot (its KV blocks as tree
nodes, its state in a snapshot slot, a partial page if it ends inside a block), so admission
then restores it exactly as any pool hit, and every block and slot stays accounted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.cache.tiers.chain import Loaded
from baton.cache.tree import Snapshot

if TYPE_CHECKING:
    from baton.cache.manager import HybridCacheManager


def spill(m: HybridCacheManager, snap: Snapshot) -> None:
    """`tree.on_evict`: write the snapshot (still intact in the pool) to the tiers."""
    tree = m.tree
    blocks = tree.path_blocks(snap.node) if m.blocks is not None else []
    if snap.is_partial and snap.page is not None:
        blocks = [*blocks, snap.page]
    m.tiers.spill(tree.snapshot_tokens(snap), blocks, snap.slot, m.saved_flops(snap.num_tokens))


def materialize(m: HybridCacheManager, tokens: list[int], got: Loaded) -> bool:
    """Put a loaded entry of `tokens[:n]` into the tree; False (nothing changed) when the
    pool has no room for it now (then the request computes, as on a miss)."""
    store, tree, tpb, h = m.store, m.tree, m.tpb, got.header
    n = h.n
    full, kv = n // tpb, m.blocks is not None
    node = tree.match_blocks(tokens, full * tpb)
    tree.lock(node)  # the shared part of the path must survive the allocations below
    fresh: list[int] = []
    slot = page = None
    try:
        if kv:
            for _ in range(full - node.depth + (n % tpb > 0)):
                b = store.alloc_block(required=False)
                if b is None:
                    return _undo(m, fresh, None)
                fresh.append(b)
        slot = store.snapshot_slot()
        if slot is None:
            return _undo(m, fresh, None)
        new_full = fresh[: full - node.depth] if kv else []
        if kv and n % tpb:
            page = fresh[-1]
        m.layout.scatter(h, got.payload, fresh, node.depth, slot)
        path = tree.path_blocks(node) + new_full if kv else [None] * full
        end = tree.insert(tokens[: full * tpb], path)
        for b in new_full:
            m.blocks.decref(b)  # the tree's own reference stands
        if n % tpb:
            tree.add_partial(end, tuple(tokens[full * tpb : n]), slot, page)
        elif end.snapshot is None:
            tree.add_snapshot(end, slot, n)
        else:  # the pool got this snapshot meanwhile: keep it, drop the copy
            m.slots.release(slot)
        m.store.restored += 1
        return True
    finally:
        tree.unlock(node)


def _undo(m: HybridCacheManager, fresh: list[int], slot: int | None) -> bool:
    for b in fresh:
        m.blocks.decref(b)
    if slot is not None:
        m.slots.release(slot)
    return False
