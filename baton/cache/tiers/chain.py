"""The tiers behind one worker's pool, in order: disk (this host), then the shared store.

    pool ──evict──▶ spill: one entry (the snapshot's whole-path KV + its state) to each tier
    admit ──miss──▶ find: the deepest entry for the prompt in (pool hit, len - 1]; load it,
                    put it back into the pool's tree as a snapshot, then admit as a pool hit

Lookup keys are the contract's snapshot hash of the prompt's first n tokens, for each n some
entry of the tier holds (the tier's `lengths`), so one chained hash per block serves them all.
A restore never covers the last prompt token (its logits are needed), exactly as a pool hit.

With `background` (every worker's tiers), writes and reads run on the tiers' I/O thread
(background.py): `spill` copies the snapshot out of the pool on the caller's thread (its
blocks are reused right after) and queues the checksums and the write; `start_load` posts the
read and returns a future the engine polls while the request waits in the "restoring" state
and other requests keep stepping. An entry queued for writing counts as present (a read
posted after it runs after it). Without `background` every call completes before it returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import torch

from baton.cache.tiers.background import IOThread
from baton.cache.tiers.entry import Header, Layout
from baton.contract.prefix_hash import block_hashes, tail_hash

log = logging.getLogger("baton.cache.tiers")


class Loaded(NamedTuple):
    tier: object
    header: Header
    payload: torch.Tensor


MAX_PENDING_BYTES = 256 << 20
"""Bytes of entries queued for writing at most; a spill past it waits for the writes."""


class Tiers:
    def __init__(self, layout: Layout, disk=None, shared=None, background: bool = False,
                 max_pending_bytes: int = MAX_PENDING_BYTES):
        self.layout = layout
        self.tiers = [t for t in (disk, shared) if t is not None]
        self.disk, self.shared = disk, shared
        self.io = IOThread() if background else None
        self.on_ready: Callable[[], None] | None = None
        """Called on the I/O thread when a posted read finishes (wakes an idle engine loop)."""
        self.max_pending_bytes = max_pending_bytes
        self._cond = threading.Condition()
        self._pending: dict[int, tuple[int, frozenset[str]]] = {}
        """Entries queued for writing: snapshot hash -> (tokens, names of the tiers)."""
        self._pending_bytes = 0

    def keys(self, tokens: list[int], lengths: list[int]) -> list[tuple[int, str, int]]:
        """(n, snapshot hash) for each n in `lengths`, deepest first."""
        tpb = self.layout.tpb
        bh = block_hashes(tokens[: max(lengths, default=0)], tpb)
        return [(n, tail_hash(bh[n // tpb], tokens, n, tpb)) for n in sorted(lengths)[::-1]]

    # ---- eviction from the pool ---------------------------------------------------------
    def spill(self, tokens: list[int], blocks: list[int], slot: int, saved: float) -> None:
        """Write a snapshot about to leave the pool to every tier (skipping what is there or
        queued): copied out now, checksummed and written on the I/O thread."""
        n = len(tokens)
        (_, h), = self.keys(tokens, [n])
        with self._cond:
            queued = self._pending.get(h, (0, frozenset()))[1]
        todo = [t for t in self.tiers if t.name not in queued
                and not (t is self.disk and t.has(t.key(h)))]
        if not todo:
            return
        tpb = self.layout.tpb
        bh = block_hashes(tokens[: n // tpb * tpb], tpb)[-1]
        payload = self.layout.copy_out(tokens, blocks, slot)
        if self.io is None:
            self._write(h, n, payload, saved, bh, todo)
            return
        size = payload.numel()
        with self._cond:
            self._cond.wait_for(lambda: self._pending_bytes + size <= self.max_pending_bytes
                                or not self._pending)
            names = self._pending.get(h, (n, frozenset()))[1]
            self._pending[h] = (n, names | {t.name for t in todo})
            self._pending_bytes += size
        self.io.post(lambda: self._write(h, n, payload, saved, bh, todo, size))

    def _write(self, h: int, n: int, payload, saved: float, bh: int, todo: list,
               size: int = 0) -> None:
        try:
            header = self.layout.seal(n, payload, saved, bh)
            for t in todo:
                try:
                    t.put(t.key(h), header, payload)
                except Exception as e:  # noqa: BLE001 - a failed write is an entry not kept
                    t.stats.errors += 1
                    log.warning("%s tier write failed (%s); entry not kept", t.name, e)
        finally:
            if size:
                with self._cond:
                    left = self._pending.get(h, (n, frozenset()))[1] - {t.name for t in todo}
                    if left:
                        self._pending[h] = (n, left)
                    else:
                        self._pending.pop(h, None)
                    self._pending_bytes -= size
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every queued write and read; False on timeout."""
        return True if self.io is None else self.io.flush(timeout)

    def close(self) -> None:
        """Finish the queued writes, then stop the I/O thread."""
        if self.io is not None:
            self.io.close()

    # ---- admission ----------------------------------------------------------------------
    def peek(self, prompt: list[int], lo: int, hi: int) -> int:
        """Tokens the deepest entry for `prompt` (lo < n <= hi) covers, unchecked; lo if none."""
        options = self._options(prompt, lo, hi)
        return -options[0][0] if options else lo

    def load(self, prompt: list[int], lo: int, hi: int) -> Loaded | None:
        """The deepest checked entry for `prompt` covering n tokens, lo < n <= hi (waits for
        queued writes first, so it sees them)."""
        self.flush()
        return self._load(prompt, self._options(prompt, lo, hi))

    def start_load(self, prompt: list[int], lo: int, hi: int) -> Future | None:
        """Post the read of the deepest entry for `prompt` (lo < n <= hi): a future of the
        checked `Loaded`, or of None (a miss: absent, failed a check, or the read failed).
        None when no tier holds or queues a deeper entry (nothing posted)."""
        options = self._options(prompt, lo, hi)
        if not options:
            return None
        fut: Future = Future()

        def job() -> None:
            try:
                got = self._load(prompt, options)
            except Exception as e:  # noqa: BLE001 - a read that fails is a miss
                log.warning("tier read failed (%s): a miss, the prefix is computed", e)
                options[0][2].stats.errors += 1
                got = None
            fut.set_result(got)
            if self.on_ready is not None:
                self.on_ready()

        if self.io is None:
            job()
        else:
            self.io.post(job)
        return fut

    def _load(self, prompt: list[int], options: list[tuple]) -> Loaded | None:
        for _, _, t, key in options:
            start = time.perf_counter()
            got = t.get(key, prompt)
            if got is not None:
                t.stats.load_seconds += time.perf_counter() - start
                t.stats.bytes_read += got[1].numel() if t is self.disk else 0
                return Loaded(t, *got)
        return None

    def _options(self, prompt: list[int], lo: int, hi: int) -> list[tuple]:
        """(-n, tier rank, tier, key) of each tier's deepest entry (held or queued), deepest
        first."""
        with self._cond:
            queued = {h: names for h, (n, names) in self._pending.items() if lo < n <= hi}
            queued_n = {self._pending[h][0] for h in queued}
        options = []
        for rank, t in enumerate(self.tiers):
            lengths = {n for n in t.lengths() if lo < n <= hi} | queued_n
            if not lengths:
                continue
            cands = [(n, h, t.key(h)) for n, h in self.keys(prompt, sorted(lengths))]
            mine = next(((n, k) for n, h, k in cands if t.name in queued.get(h, ())), None)
            if t is self.disk:
                found = next(((n, k) for n, h, k in cands
                              if t.has(k) or t.name in queued.get(h, ())), None)
            else:
                found = t.find([(n, k) for n, _, k in cands if not mine or n > mine[0]])
                found = found or mine
            if found is not None:
                options.append((-found[0], rank, t, found[1]))
        return sorted(options, key=lambda o: o[:2])

    def counters(self) -> dict[str, dict]:
        return {t.name: t.stats.as_dict() for t in self.tiers}
