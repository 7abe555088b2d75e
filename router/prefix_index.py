"""Which workers hold which snapshots: the prefix_aware policy's bounded, LRU-evicted index.

    nodes (LRU order, oldest first)
      block_hash(k) -> { (snapshot_hash, n): {worker ids} }     k = n // tokens_per_block

A node is touched when a snapshot is inserted under it or a prompt matches through it.
The index holds at most `max_entries` (block_hash, snapshot_hash, n) entries; past that,
whole least-recently-used nodes go. Forgetting a snapshot only costs a missed hit, never a
wrong one: a hit is counted only for a snapshot a worker reported and has not evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from baton.contract import SnapshotEvent
from baton.contract.prefix_hash import block_hashes, tail_hash

_Entry = tuple[int, int]  # (snapshot_hash, num_tokens)


class PrefixIndex:
    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError(f"prefix index max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._nodes: OrderedDict[int, dict[_Entry, set[str]]] = OrderedDict()
        self._by_worker: dict[str, set[tuple[int, _Entry]]] = {}
        self._size = 0

    def __len__(self) -> int:
        """Snapshot entries tracked (each a distinct prefix, any number of workers)."""
        return self._size

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def tracked(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def apply(self, worker_id: str, events: Iterable[SnapshotEvent]) -> None:
        for ev in events:
            if ev.inserted:
                self._insert(worker_id, ev.block_hash, (ev.snapshot_hash, ev.num_tokens))
            else:
                self._remove(worker_id, ev.block_hash, (ev.snapshot_hash, ev.num_tokens))
        self._shrink()

    def remove_worker(self, worker_id: str) -> None:
        for bh, entry in list(self._by_worker.get(worker_id, ())):
            self._remove(worker_id, bh, entry)
        self._by_worker.pop(worker_id, None)

    def match(
        self, tokens: Sequence[int], tokens_per_block: int, hashes: Sequence[int] | None = None
    ) -> dict[str, int]:
        """Per worker, the most prompt tokens a snapshot it holds covers (never the last token).

        `hashes`: prompt_block_hashes(tokens, tokens_per_block), when the caller has them."""
        usable = len(tokens) - 1
        best: dict[str, int] = {}
        if hashes is None:
            hashes = prompt_block_hashes(tokens, tokens_per_block)
        for k, bh in enumerate(hashes):
            node = self._nodes.get(bh)
            if node is None:
                continue
            self._nodes.move_to_end(bh)
            for (sh, n), workers in node.items():
                if n > usable or n // tokens_per_block != k:
                    continue
                if tail_hash(bh, tokens, n, tokens_per_block) != sh:
                    continue
                for w in workers:
                    if n > best.get(w, 0):
                        best[w] = n
        return best

    def check_integrity(self) -> None:
        """Asserts the forward and per-worker maps agree and the bound holds."""
        pairs = {
            (w, bh, e) for bh, node in self._nodes.items() for e, ws in node.items() for w in ws
        }
        back = {(w, bh, e) for w, items in self._by_worker.items() for bh, e in items}
        assert pairs == back, f"index maps disagree: {len(pairs)} vs {len(back)}"
        assert self._size == sum(len(n) for n in self._nodes.values()) <= self.max_entries
        assert all(ws for node in self._nodes.values() for ws in node.values()), "empty entry"

    def _insert(self, worker_id: str, bh: int, entry: _Entry) -> None:
        node = self._nodes.get(bh)
        if node is None:
            node = self._nodes[bh] = {}
        self._nodes.move_to_end(bh)
        workers = node.get(entry)
        if workers is None:
            workers = node[entry] = set()
            self._size += 1
        workers.add(worker_id)
        self._by_worker.setdefault(worker_id, set()).add((bh, entry))

    def _remove(self, worker_id: str, bh: int, entry: _Entry) -> None:
        node = self._nodes.get(bh)
        workers = None if node is None else node.get(entry)
        if workers is None or worker_id not in workers:
            return
        workers.discard(worker_id)
        self._by_worker[worker_id].discard((bh, entry))
        if not workers:
            del node[entry]
            self._size -= 1
            if not node:
                del self._nodes[bh]

    def _shrink(self) -> None:
        while self._size > self.max_entries:
            bh, node = self._nodes.popitem(last=False)
            for entry, workers in node.items():
                self._size -= 1
                for w in workers:
                    self._by_worker[w].discard((bh, entry))


def prompt_block_hashes(tokens: Sequence[int], tokens_per_block: int) -> list[int]:
    """The block hashes a match of `tokens` probes (the last token is never covered)."""
    return block_hashes(tokens[: len(tokens) - 1], tokens_per_block)
