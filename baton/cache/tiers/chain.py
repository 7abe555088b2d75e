"""The tiers behind one worker's pool, in order: disk (this host), then the shared store.

    pool ──evict──▶ spill: one entry (the snapshot's whole-path KV + its state) to each tier
    admit ──miss──▶ find: the deepest entry for the prompt in (pool hit, len - 1]; load it,
                    put it back into the pool's tree as a snapshot, then admit as a pool hit

Lookup keys are the contract's snapshot hash of the prompt's first n tokens, for each n some
entry of the tier holds (the tier's `lengths`), so one chained hash per block serves them all.
A restore never covers the last prompt token (its logits are needed), exactly as a pool hit.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from baton.cache.tiers.entry import Header, Layout
from baton.contract.prefix_hash import block_hashes, tail_hash

log = logging.getLogger("baton.cache.tiers")


class Loaded(NamedTuple):
    tier: object
    header: Header
    payload: torch.Tensor


class Tiers:
    def __init__(self, layout: Layout, disk=None, shared=None):
        self.layout = layout
        self.tiers = [t for t in (disk, shared) if t is not None]
        self.disk, self.shared = disk, shared

    def keys(self, tokens: list[int], lengths: list[int]) -> list[tuple[int, str, int]]:
        """(n, snapshot hash) for each n in `lengths`, deepest first."""
        tpb = self.layout.tpb
        bh = block_hashes(tokens[: max(lengths, default=0)], tpb)
        return [(n, tail_hash(bh[n // tpb], tokens, n, tpb)) for n in sorted(lengths)[::-1]]

    # ---- eviction from the pool ---------------------------------------------------------
    def spill(self, tokens: list[int], blocks: list[int], slot: int, saved: float) -> None:
        """Write a snapshot about to leave the pool to every tier (skipping what is there)."""
        n = len(tokens)
        (_, h), = self.keys(tokens, [n])
        todo = [t for t in self.tiers if not (t is self.disk and t.has(t.key(h)))]
        if not todo:
            return
        tpb = self.layout.tpb
        header, payload = self.layout.gather(tokens, blocks, slot, saved,
                                             bh=block_hashes(tokens[: n // tpb * tpb], tpb)[-1])
        for t in todo:
            t.put(t.key(h), header, payload)

    # ---- admission ----------------------------------------------------------------------
    def peek(self, prompt: list[int], lo: int, hi: int) -> int:
        """Tokens the deepest entry for `prompt` (lo < n <= hi) covers, unchecked; lo if none."""
        options = self._options(prompt, lo, hi)
        return -options[0][0] if options else lo

    def load(self, prompt: list[int], lo: int, hi: int) -> Loaded | None:
        """The deepest checked entry for `prompt` covering n tokens, lo < n <= hi."""
        for _, _, t, key in self._options(prompt, lo, hi):
            start = time.perf_counter()
            got = t.get(key, prompt)
            if got is not None:
                t.stats.load_seconds += time.perf_counter() - start
                t.stats.bytes_read += got[1].numel() if t is self.disk else 0
                return Loaded(t, *got)
        return None

    def _options(self, prompt: list[int], lo: int, hi: int) -> list[tuple]:
        """(-n, tier rank, tier, key) of each tier's deepest entry, deepest first."""
        options = []
        for rank, t in enumerate(self.tiers):
            lengths = [n for n in t.lengths() if lo < n <= hi]
            if not lengths:
                continue
            cands = [(n, t.key(h)) for n, h in self.keys(prompt, lengths)]
            if t is self.disk:
                found = next(((n, k) for n, k in cands if t.has(k)), None)
            else:
                found = t.find(cands)
            if found is not None:
                options.append((-found[0], rank, t, found[1]))
        return sorted(options, key=lambda o: o[:2])

    def counters(self) -> dict[str, dict]:
        return {t.name: t.stats.as_dict() for t in self.tiers}
