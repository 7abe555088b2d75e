"""The prefix tree: one node per full KV block, Mamba snapshots hung on nodes, LRU eviction.

    root ─[t0..t15]─ A(block 3) ─[t16..t31]─ B(block 7, snapshot slot 5 @ 32 tokens)
                     │                       └ partial: tail t32..t36, slot 6, page 9 @ 37
                     └─[u16..u31]─ C(block 8)   tombstone: KV kept, snapshot evicted

A node's KV block exists as long as the node does, so every snapshot on a path has all
its KV present; KV eviction removes leaves only. A *partial* snapshot ends inside the
block after its node: it keeps a private copy of that partial page (`page`), and a node
keeps at most one (the latest commit in that block wins).

Two LRU orders, accounted separately:
  - KV units (nodes and partial snapshots): a node is evictable when unlocked, childless
    and without a partial; evicting it frees its block and its snapshot slot, if any.
  - snapshots (full and partial): any may be dropped to free a slot, leaving a tombstone.
    A snapshot is copied into the live slot at admission, so it never needs pinning.
Locks pin the KV of a path: `lock(node)` counts on node and every ancestor.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from baton.cache.allocators import BlockAllocator, SlotAllocator


@dataclass(eq=False)
class Snapshot:
    slot: int
    """State slot holding every state tensor after exactly `num_tokens` tokens."""
    num_tokens: int
    node: Node
    """Full snapshot: the node it ends at. Partial: the node its `tail` continues."""
    tail: tuple[int, ...] = ()
    """Tokens past `node`'s blocks (partial snapshots only, 0 < len < tokens_per_block)."""
    page: int | None = None
    """Copied KV page holding `tail` (partial snapshots; None on attention-free stages)."""
    last: int = 0
    """Logical time of its last use (the tree's `clock`), for value-aware eviction."""

    @property
    def is_partial(self) -> bool:
        return bool(self.tail)

    @property
    def alive(self) -> bool:
        return self.node.snapshot is self or self.node.partial is self


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    """The block's tokens (the edge key from the parent)."""
    block: int | None
    parent: Node | None
    depth: int
    """Full blocks from the root to here (this node's snapshot covers depth*tpb tokens)."""
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    partial: Snapshot | None = None
    lock_ref: int = 0
    last: int = 0


class MatchResult(NamedTuple):
    node: Node
    """Deepest node whose blocks the match uses (the root when none)."""
    snapshot: Snapshot | None
    cached_tokens: int


class PrefixTree:
    def __init__(self, tokens_per_block: int, blocks: BlockAllocator | None, slots: SlotAllocator):
        self.tpb = tokens_per_block
        self.blocks = blocks  # None on attention-free stages: nodes carry no block
        self.slots = slots
        self.root = Node((), None, None, 0)
        self._kv_lru: OrderedDict[Node | Snapshot, None] = OrderedDict()
        self._state_lru: OrderedDict[Snapshot, None] = OrderedDict()
        self.num_nodes = 0
        self.num_locked = 0
        self.num_partials = 0
        self.blocks_evicted = 0
        self.snapshots_evicted = 0
        self.listener: Callable[[bool, Snapshot], None] | None = None
        """Told of every snapshot added (True) or dropped (False), e.g. to inform a router."""
        self.pinned: Snapshot | None = None
        """A partial snapshot being restored: KV eviction must not take its page meanwhile."""
        self.clock = 0
        """Logical time: bumped on every touch."""
        self.on_evict: Callable[[Snapshot], None] | None = None
        """Told of each snapshot about to be evicted for room (its slot and blocks still hold
        it), e.g. to write it to a tier; not of snapshots retired or replaced."""
        self.victim: Callable[[list], Node | Snapshot] | None = None
        """Chooses which of the evictable units goes first; None: least recently used."""

    # ---- lookup ------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int) -> MatchResult:
        """Deepest snapshot on `tokens`' path covering at most `limit` tokens; touches it."""
        tpb, node = self.tpb, self.root
        best = MatchResult(self.root, None, 0)
        while True:
            start, p = node.depth * tpb, node.partial
            if p is not None and start + len(p.tail) <= limit:
                if tuple(tokens[start : start + len(p.tail)]) == p.tail:
                    best = MatchResult(node, p, p.num_tokens)
            if start + tpb > limit:
                break
            child = node.children.get(tuple(tokens[start : start + tpb]))
            if child is None:
                break
            node = child
            if node.snapshot is not None:
                best = MatchResult(node, node.snapshot, node.snapshot.num_tokens)
        self.touch_path(best.node)
        if best.snapshot is not None:
            self.touch(best.snapshot)
        return best

    def match_blocks(self, tokens: list[int], limit: int) -> Node:
        """Deepest node whose full blocks all lie within `tokens[:limit]` (KV only); touches."""
        tpb, node = self.tpb, self.root
        while (node.depth + 1) * tpb <= limit:
            start = node.depth * tpb
            child = node.children.get(tuple(tokens[start : start + tpb]))
            if child is None:
                break
            node = child
        self.touch_path(node)
        return node

    @staticmethod
    def path(node: Node) -> list[Node]:
        """Nodes from the root's child down to `node`."""
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def path_blocks(self, node: Node) -> list[int]:
        return [n.block for n in self.path(node) if n.block is not None]

    # ---- insertion ---------------------------------------------------------------------
    def insert(self, tokens: list[int], blocks: list[int | None]) -> Node:
        """Add the path of `len(blocks)` full blocks of `tokens`; existing nodes are kept."""
        node = self.root
        for k, b in enumerate(blocks):
            key = tuple(tokens[k * self.tpb : (k + 1) * self.tpb])
            child = node.children.get(key)
            if child is None:
                child = Node(key, b, node, node.depth + 1)
                if b is not None:
                    self.blocks.incref(b)
                node.children[key] = child
                self.num_nodes += 1
            self.touch(child)
            node = child
        return node

    def add_snapshot(self, node: Node, slot: int, num_tokens: int) -> Snapshot:
        assert node.snapshot is None and node is not self.root
        snap = node.snapshot = Snapshot(slot, num_tokens, node)
        self.touch(snap)
        self._notify(True, snap)
        return snap

    def add_partial(
        self, node: Node, tail: tuple[int, ...], slot: int, page: int | None
    ) -> Snapshot:
        if node.partial is not None:
            self.drop(node.partial, prune=False)  # within one block only the latest is kept
        snap = node.partial = Snapshot(slot, node.depth * self.tpb + len(tail), node, tail, page)
        self.num_partials += 1
        self.touch(snap)
        self._notify(True, snap)
        return snap

    def _notify(self, added: bool, snap: Snapshot) -> None:
        if self.listener is not None:
            self.listener(added, snap)

    def snapshot_tokens(self, snap: Snapshot) -> list[int]:
        """The exact tokens a snapshot's state follows."""
        toks = [t for n in self.path(snap.node) for t in n.tokens]
        return (toks + list(snap.tail))[: snap.num_tokens]

    # ---- LRU and locks -----------------------------------------------------------------
    def touch(self, unit: Node | Snapshot) -> None:
        self.clock += 1
        unit.last = self.clock
        if isinstance(unit, Snapshot):
            self._state_lru[unit] = None
            self._state_lru.move_to_end(unit)
            if not unit.is_partial:
                return
        self._kv_lru[unit] = None
        self._kv_lru.move_to_end(unit)

    def touch_path(self, node: Node) -> None:
        for n in self.path(node):
            self.touch(n)

    def lock(self, node: Node) -> None:
        for n in self.path(node):
            self.num_locked += n.lock_ref == 0
            n.lock_ref += 1

    def unlock(self, node: Node) -> None:
        for n in self.path(node):
            assert n.lock_ref > 0, f"unlock of unlocked node at depth {n.depth}"
            n.lock_ref -= 1
            self.num_locked -= n.lock_ref == 0
        self._prune(node)

    # ---- eviction ----------------------------------------------------------------------
    @property
    def num_snapshots(self) -> int:
        return len(self._state_lru)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks that evicting every evictable unit would free (unlocked nodes, partial pages)."""
        if self.blocks is None:
            return 0
        return self.num_nodes - self.num_locked + self.num_partials

    def drop(self, snap: Snapshot, prune: bool = True) -> None:
        """Remove a snapshot (its node stays, as a tombstone if it was a full snapshot)."""
        self._notify(False, snap)
        if snap.is_partial:
            assert snap.node.partial is snap
            snap.node.partial = None
            self.num_partials -= 1
            del self._kv_lru[snap]
            if snap.page is not None:
                self.blocks.decref(snap.page)
        else:
            assert snap.node.snapshot is snap
            snap.node.snapshot = None
        del self._state_lru[snap]
        self.slots.release(snap.slot)
        if prune:
            self._prune(snap.node)

    def _evictable(self, unit: Node | Snapshot) -> bool:
        if unit is self.pinned:
            return False
        if isinstance(unit, Snapshot):
            return True
        return unit.lock_ref == 0 and not unit.children and unit.partial is None

    def evict_block(self) -> bool:
        """Evict a KV unit (the least recently used, or `victim`'s pick); False when nothing
        is evictable."""
        if self.victim is not None:
            unit = self.victim([u for u in self._kv_lru if self._evictable(u)])
        else:
            unit = next((u for u in self._kv_lru if self._evictable(u)), None)
        if unit is None:
            return False
        if isinstance(unit, Snapshot):
            self._evicting(unit)
            self.drop(unit)
            self.snapshots_evicted += 1
        else:
            self._remove(unit, evicted=True)
        self.blocks_evicted += 1
        return True

    def evict_snapshot(self) -> bool:
        """Drop a snapshot (the least recently used, or `victim`'s pick), freeing its slot;
        False when there is none."""
        if not self._state_lru:
            return False
        snaps = list(self._state_lru)
        snap = self.victim(snaps) if self.victim is not None else snaps[0]
        self._evicting(snap)
        self.drop(snap)
        self.snapshots_evicted += 1
        return True

    def _evicting(self, snap: Snapshot) -> None:
        if self.on_evict is not None:
            self.on_evict(snap)

    def _remove(self, node: Node, evicted: bool = False) -> None:
        if node.snapshot is not None:
            if evicted:
                self._evicting(node.snapshot)
            self.drop(node.snapshot, prune=False)
            self.snapshots_evicted += 1
        del node.parent.children[node.tokens]
        del self._kv_lru[node]
        self.num_nodes -= 1
        if node.block is not None:
            self.blocks.decref(node.block)

    def _prune(self, node: Node) -> None:
        """Attention-free stages: drop tombstone leaves at once (no KV makes them useful).

        With KV a tombstone path still serves `admit_remote` and deeper snapshots, and KV
        eviction bounds the tree; without KV nothing else would ever remove them.
        """
        if self.blocks is not None:
            return
        while (
            node.parent is not None and not node.children and node.lock_ref == 0
            and node.snapshot is None and node.partial is None
        ):
            parent = node.parent
            self._remove(node)
            node = parent

    # ---- inspection --------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        """Every node but the root, parents before children."""
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n is not self.root:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def lru_units(self) -> tuple[list[Node | Snapshot], list[Snapshot]]:
        return list(self._kv_lru), list(self._state_lru)
