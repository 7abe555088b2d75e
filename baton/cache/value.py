"""What a snapshot is worth: the prefill FLOPs it saves per byte it holds, and the eviction
order that follows from it (Marconi, MLSys 2025) or from recency alone (LRU).

FLOPs of computing prompt tokens [p, n) given the cache after p: linear * (n - p) +
quadratic * (n^2 - p^2), the two terms each family's config declares (`prefill_flops()`,
summed over its layer kinds' costs in `baton.model.flops`).

The score of a candidate is alpha * norm(FLOPs saved / bytes) + norm(recency), both min-max
normalised over the candidates, recency = 1 / (now - last use) on a logical clock; the lowest
goes first, ties to the least recently used. With `policy: lru` only the last use counts.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from baton.config.cache_tiers import EvictionConfig
from baton.contract.prefix_hash import block_hashes


@dataclass(frozen=True)
class FlopModel:
    linear: float
    """FLOPs per token that do not depend on its position (all layers)."""
    quadratic: float
    """Attention's position term: computing tokens [p, n) costs quadratic * (n^2 - p^2)."""

    def saved(self, n: int, p: int = 0) -> float:
        """FLOPs of computing tokens [p, n) from the cache after p."""
        return self.linear * (n - p) + self.quadratic * (n * n - p * p)

    @classmethod
    def for_model(cls, m) -> FlopModel:
        """From any family's config: its `prefill_flops()` (per token, the position term),
        which each family sums over its layer kinds (`baton.model.flops`)."""
        lin, quad = m.prefill_flops()
        return cls(float(lin), float(quad))


class Candidate(NamedTuple):
    unit: object
    saved: float
    """FLOPs a hit on it saves."""
    nbytes: int
    """Bytes it holds."""
    last: int
    """Logical time of its last use."""


def pick_victim(cands: Sequence[Candidate], now: int, cfg: EvictionConfig):
    """The candidate to evict first under `cfg` (None when there is none)."""
    if not cands:
        return None
    if cfg.policy == "lru":
        return min(cands, key=lambda c: c.last).unit
    eff = [c.saved / max(c.nbytes, 1) for c in cands]
    rec = [1.0 / max(now - c.last, 1) for c in cands]
    ne, nr = _norm(eff), _norm(rec)
    scores = [cfg.alpha * e + r for e, r in zip(ne, nr, strict=True)]
    best = min(range(len(cands)), key=lambda i: (scores[i], cands[i].last))
    return cands[best].unit


def _norm(xs: list[float]) -> list[float]:
    lo, hi = min(xs), max(xs)
    if hi <= lo:
        return [0.0] * len(xs)
    return [(x - lo) / (hi - lo) for x in xs]


def tree_victim(m, units: list):
    """`PrefixTree.victim` of a manager under `cache.eviction.policy: value`: scores the pool's
    evictable snapshots and KV units. A snapshot saves the FLOPs from the deepest snapshot
    above it to its own end; a tombstone node (KV without a snapshot) saves nothing by itself.
    Bytes are what evicting the unit frees (not its whole path's KV, as Marconi counts: that
    ranks every deep snapshot of a long conversation lowest, the very ones its next turn
    reuses; measured in docs/cache-tiers.md)."""
    from baton.cache.tree import Snapshot

    kv_b, st_b = _unit_bytes(m)
    cands = []
    for u in units:
        snap = u if isinstance(u, Snapshot) else u.snapshot
        saved = m.saved_flops(snap.num_tokens, _parent_tokens(snap, m.tpb)) if snap else 0.0
        cands.append(Candidate(u, saved, _freed_bytes(u, kv_b, st_b), u.last))
    return pick_victim(cands, m.tree.clock + 1, m.eviction_now())


def _freed_bytes(u, kv_b: int, st_b: int) -> int:
    """Bytes evicting `u` frees: a snapshot its state slot (and a partial one its page); a
    KV unit (a leaf node) its block, and its snapshot's slot if it carries one."""
    from baton.cache.tree import Snapshot

    if isinstance(u, Snapshot):
        return st_b + (kv_b if u.is_partial and u.page is not None else 0)
    return kv_b + (st_b if u.snapshot is not None else 0)


def _parent_tokens(snap, tpb: int) -> int:
    node = snap.node if snap.is_partial else snap.node.parent
    while node is not None and node.snapshot is None:
        node = node.parent
    return node.depth * tpb if node is not None else 0


def _unit_bytes(m) -> tuple[int, int]:
    import torch

    s = m.pools.spec
    item = torch.empty((), dtype=s.dtype).element_size()
    kv = len(s.attn_layers) * 2 * s.tokens_per_block * s.num_kv_heads * s.head_dim * item
    return kv, (s.state_bytes_per_slot() if s.state_layers else 0)


ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
"""The candidate alphas `AlphaTuner` compares."""


class AlphaTuner:
    """Online tuning of alpha (Marconi, MLSys 2025, section 4.3, in a cheaper form): instead of
    replaying a window of requests against a copy of the tree for each candidate alpha, each
    candidate keeps a shadow of the pool's snapshot slots (keys, token counts, FLOPs saved,
    last use: no KV, no tensors) fed every admitted prompt as it comes. Every `window`
    admissions the pool takes the alpha whose shadow saved the most prefill FLOPs over the
    last `window` prompts (the current one on a tie). Shadows count slots, not KV blocks."""

    def __init__(self, flops: FlopModel, tpb: int, budget: int, cfg: EvictionConfig,
                 alphas: Sequence[float] = ALPHAS, window: int = 32):
        self.flops, self.tpb, self.window = flops, tpb, window
        self.cfg = cfg
        """The eviction config in force (its alpha the tuned one)."""
        self.shadows = [_Shadow(a, budget) for a in alphas]
        self._recent = [deque(maxlen=window) for _ in alphas]
        self.seen = self.changes = 0

    @property
    def alpha(self) -> float:
        return self.cfg.alpha

    def observe(self, prompt: list[int], points: list[int]) -> None:
        """An admitted prompt with its snapshot points: each shadow serves it."""
        tpb = self.tpb
        bh = block_hashes(prompt, tpb)

        def key(n: int) -> tuple:
            return bh[n // tpb], tuple(prompt[n // tpb * tpb : n])

        for sh, rec in zip(self.shadows, self._recent, strict=True):
            rec.append(sh.serve(key, points, len(prompt) - 1, self.flops))
        self.seen += 1
        if self.seen % self.window == 0:
            totals = {sh.cfg.alpha: sum(rec) for sh, rec in zip(self.shadows, self._recent,
                                                                strict=True)}
            best = max(totals.values())
            if totals.get(self.alpha, -1.0) < best:
                alpha = next(a for a, t in totals.items() if t == best)
                self.cfg = replace(self.cfg, alpha=alpha)
                self.changes += 1


class _Shadow:
    """A pool of `budget` snapshot slots under one alpha, keys only."""

    def __init__(self, alpha: float, budget: int):
        self.cfg = EvictionConfig("value", alpha)
        self.budget = max(budget, 1)
        self.entries: dict[tuple, list] = {}
        """key -> [tokens, FLOPs saved over its parent, last use]"""
        self.lengths: Counter[int] = Counter()
        self.clock = 0

    def serve(self, key, points: list[int], hi: int, flops: FlopModel) -> float:
        """FLOPs the deepest held snapshot (<= hi tokens) saves; then the prompt's points
        past it are taken, evicting by the score."""
        hit = 0
        for n in sorted((n for n in self.lengths if n <= hi), reverse=True):
            e = self.entries.get(key(n))
            if e is not None:
                hit = n
                self.clock += 1
                e[2] = self.clock
                break
        p = hit
        for n in points:
            if n <= hit:
                continue
            k = key(n)
            if k not in self.entries:
                self.clock += 1
                self.entries[k] = [n, flops.saved(n, p), self.clock]
                self.lengths[n] += 1
                self._evict(k)
            p = n
        return flops.saved(hit)

    def _evict(self, keep: tuple) -> None:
        while len(self.entries) > self.budget:
            cands = [Candidate(k, e[1], 1, e[2]) for k, e in self.entries.items() if k != keep]
            k = pick_victim(cands, self.clock + 1, self.cfg)
            n = self.entries.pop(k)[0]
            self.lengths[n] -= 1
            if not self.lengths[n]:
                del self.lengths[n]
