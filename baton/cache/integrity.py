"""`check_integrity()`: every block and slot is free or owned exactly once, counts agree.

Owners: a live request owns its slot and one reference per block-table entry; a tree node
owns one reference on its block and its snapshot's slot; a partial snapshot owns its slot
and its copied page; a quarantined reservation owns one reference per kept block and its
slot (if kept). Raises AssertionError naming the first id or count that disagrees.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from baton.cache.tree import Node, PrefixTree, Snapshot

if TYPE_CHECKING:
    from baton.cache.manager import HybridCacheManager


def check_manager(m: HybridCacheManager) -> None:
    nodes = m.tree.nodes()
    snaps = _check_tree(m.tree, nodes)
    _check_locks(m, nodes)
    _check_slots(m, snaps)
    if m.blocks is not None:
        _check_blocks(m, nodes, snaps)


def _check_tree(tree: PrefixTree, nodes: list[Node]) -> list[Snapshot]:
    tpb, snaps = tree.tpb, []
    for n in nodes:
        where = f"tree node at depth {n.depth} (block {n.block})"
        assert n.parent.children.get(n.tokens) is n, f"{where} is not its parent's child"
        assert len(n.tokens) == tpb, f"{where} has {len(n.tokens)} tokens, not {tpb}"
        assert n.depth == n.parent.depth + 1, f"{where}: depth is not parent depth + 1"
        if n.snapshot is not None:
            s = n.snapshot
            assert s.node is n and not s.is_partial, f"{where}: snapshot belongs elsewhere"
            assert s.num_tokens == n.depth * tpb, f"{where}: snapshot covers {s.num_tokens}"
            snaps.append(s)
    for n in [tree.root, *nodes]:
        if n.partial is not None:
            p = n.partial
            assert p.node is n and 0 < len(p.tail) < tpb, f"partial at depth {n.depth} malformed"
            assert p.num_tokens == n.depth * tpb + len(p.tail), f"partial covers {p.num_tokens}"
            snaps.append(p)
    assert tree.root.snapshot is None, "the root holds a snapshot (zero tokens)"
    partials = [s for s in snaps if s.is_partial]
    assert tree.num_nodes == len(nodes), f"num_nodes={tree.num_nodes}, tree has {len(nodes)}"
    assert tree.num_partials == len(partials), (
        f"num_partials={tree.num_partials} != {len(partials)}"
    )
    kv_lru, state_lru = tree.lru_units()
    assert set(kv_lru) == set(nodes) | set(partials), (
        "KV LRU does not list exactly the nodes + partials"
    )
    assert len(kv_lru) == len(nodes) + len(partials), "KV LRU has duplicates"
    assert set(state_lru) == set(snaps) and len(state_lru) == len(snaps), (
        "snapshot LRU does not list exactly the tree's snapshots"
    )
    return snaps


def _check_locks(m: HybridCacheManager, nodes: list[Node]) -> None:
    want: Counter[int] = Counter()
    reachable = {id(n) for n in nodes} | {id(m.tree.root)}
    for rid, live in m.live_requests().items():
        assert id(live.node) in reachable, f"request {rid!r} locks a node no longer in the tree"
        for n in m.tree.path(live.node):
            want[id(n)] += 1
    for n in nodes:
        assert n.lock_ref == want[id(n)], (
            f"node at depth {n.depth} (block {n.block}) has lock_ref {n.lock_ref}, "
            f"but {want[id(n)]} running requests lock it"
        )
    locked = sum(1 for n in nodes if n.lock_ref)
    assert m.tree.num_locked == locked, f"num_locked={m.tree.num_locked}, counted {locked}"


def _check_slots(m: HybridCacheManager, snaps: list[Snapshot]) -> None:
    owner: dict[int, str] = {}
    ids = set(m.slots.ids())

    def own(slot: int, who: str) -> None:
        assert slot in ids, f"{who} holds slot {slot}, out of range"
        assert slot not in owner, f"slot {slot} is owned by both {owner[slot]} and {who}"
        owner[slot] = who

    live = m.live_requests()
    for rid, r in live.items():
        own(r.slot, f"request {rid!r}")
        if r.stage is not None:
            own(r.stage, f"the staged handoff of {rid!r}")
    for s in snaps:
        own(s.slot, f"the snapshot at {s.num_tokens} tokens")
    quarantined = m.quarantined()
    for rid, (_, slot) in quarantined.items():
        if slot is not None:
            own(slot, f"the quarantine of {rid!r}")
    free = m.slots.free_ids()
    assert len(free) == len(set(free)), f"slot free queue has duplicates: {sorted(free)}"
    both = set(free) & set(owner)
    assert not both, f"slot {min(both, default=None)} is free but owned by {owner.get(min(both))}"
    lost = ids - set(free) - set(owner)
    assert not lost, f"slots {sorted(lost)} are neither free nor owned (leaked)"
    assert len(snaps) <= m.snapshot_budget, (
        f"{len(snaps)} snapshots exceed the budget of {m.snapshot_budget}"
    )
    held = sum(1 for _, slot in quarantined.values() if slot is not None)
    assert len(live) + held <= m.max_live, (
        f"{len(live)} live requests and {held} quarantined slots exceed max_live {m.max_live}"
    )


def _check_blocks(m: HybridCacheManager, nodes: list[Node], snaps: list[Snapshot]) -> None:
    want: Counter[int] = Counter()
    held_by_request: dict[int, str] = {}
    for n in nodes:
        want[n.block] += 1
    for s in snaps:
        if s.page is not None:
            assert want[s.page] == 0, f"partial page {s.page} is also a tree block or page"
            want[s.page] += 1
    for rid, r in m.live_requests().items():
        assert len(r.table) == len(set(r.table)), f"request {rid!r} lists a block twice: {r.table}"
        for b in r.table:
            want[b] += 1
            held_by_request[b] = rid
    for rid, (blocks, _) in m.quarantined().items():
        assert len(blocks) == len(set(blocks)), f"quarantine {rid!r} lists a block twice"
        for b in blocks:
            want[b] += 1
            held_by_request[b] = f"the quarantine of {rid}"
    ref = m.blocks.ref
    for b in range(m.blocks.num_blocks):
        assert ref[b] == want[b], f"block {b} has ref count {ref[b]} but {want[b]} owners"
    free = m.blocks.free_ids()
    assert len(free) == len(set(free)), "block free queue has duplicates"
    zero = {b for b in range(m.blocks.num_blocks) if ref[b] == 0}
    assert set(free) == zero, (
        f"free queue and zero-ref blocks differ: {sorted(set(free) ^ zero)[:10]}"
    )
    for n in nodes:  # keeps can_allocate exact: evicting an unlocked node frees its block
        if n.lock_ref == 0 and n.block in held_by_request:
            raise AssertionError(
                f"block {n.block} of unlocked node at depth {n.depth} is held by request "
                f"{held_by_request[n.block]!r}"
            )
    for s in snaps:
        if s.page is not None and s.page in held_by_request:
            raise AssertionError(f"partial page {s.page} is held by {held_by_request[s.page]!r}")
