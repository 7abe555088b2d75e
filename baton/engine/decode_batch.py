"""The decode batch's metadata as tensors kept from step to step and updated in place.

A plain decode step (no speculation) hands the model, for its b sequences, the token ids, the
positions, the state slots and the block tables. Built afresh every step that is per-request
Python (lists of lists, one `torch.tensor` over them); but from one step to the next a batch
whose members stay the same only moves every position on by one, and a sequence's table only
gains a block when its position crosses a block boundary. So the tensors live in buffers of
`max_num_seqs` rows:

    positions[:b] += 1                      every step
    tables[i, p // tpb] = new block         only rows whose new position p is p % tpb == 0
    rebuild                                 when a request joins or leaves (or the order moves),
                                            or a position moved other than by one

`tables[:b, :nb]` is exactly what `baton.model.paged.decode_meta` builds from lists (each row
cut to the blocks its length needs, padded with its column 0), so the model computes the same
thing either way (tests/unit/engine/test_decode_batch.py checks the buffers against a rebuild after
every step of a workload where requests join and leave). Only for models that take a table
tensor (`decode_takes_tables`); pipeline and tensor-parallel models send lists over the wire.

Bucketed (`worker.decode_batch_buckets`): the views handed out are `B` rows, the smallest
bucket that holds the batch, and `W` columns, the power of two that holds its longest table,
so a decode forward only ever sees a few shapes (what CUDA graphs capture):

    rows b..B-1      pad rows: token 0 at position 0 of the cache's pad block, in its pad
                     slot (both kept out of the cache; the slot zeroed before each step)
    columns nb..W-1  a real row's padding, its column 0 as before (read only as masked keys)

A real row's tokens and states are what an unpadded step computes (the fast path's kernels
give a row the same bits in any batch; tests/unit/engine/test_decode_buckets.py).
"""

from __future__ import annotations

import torch

from baton.cache.manager import HybridCacheManager
from baton.engine.request import Request


class DecodeBatch:
    def __init__(self, cache: HybridCacheManager, capacity: int, device,
                 buckets: tuple[int, ...] = ()):
        spec = cache.pools.spec
        self.cache = cache
        self.tpb = spec.tokens_per_block
        self.has_kv = cache.pools.has_kv
        self.buckets = tuple(buckets)
        """Padded batch sizes, ascending; empty: not bucketed."""
        if self.buckets:
            if cache.pad_slot is None and cache.pad_block is None:
                raise ValueError("bucketed decode needs a cache built with pad_rows=True")
            capacity = max(capacity, self.buckets[-1])
        self.padded = 0
        """Rows of the last update's views (the bucket; the batch itself when unbucketed)."""
        opts = {"dtype": torch.long, "device": device}
        self.ids = torch.zeros(capacity, **opts)
        self.positions = torch.zeros(capacity, **opts)
        self.slots = torch.zeros(capacity, **opts)
        self.tables = torch.zeros(capacity, 16, **opts)
        """Grows (doubling its columns) when a sequence needs more blocks."""
        self.rows: list[Request] = []
        """The requests of the last update, in batch order (the buffers' rows)."""
        self._pos: list[int] = []
        """Their positions at the last update (a row moves on only from exactly there)."""
        self.width = 0
        """Columns of `tables` the batch's longest sequence needs (`nb`; bucketed, the power
        of two that holds them)."""
        self.rebuilds = 0

    def update(self, reqs: list[Request]):
        """(ids, positions, tables [b, nb], slots) of `reqs`' next decode step, each request at
        position `num_computed` reading its last output token; views of the buffers.
        Bucketed: [B] and [B, W], the first b rows `reqs`' and the rest pad rows (`padded`)."""
        b = len(reqs)
        pos = [r.num_computed for r in reqs]
        if (b != len(self.rows) or any(a is not r for a, r in zip(reqs, self.rows, strict=True))
                or any(p != q + 1 for p, q in zip(pos, self._pos, strict=True))):
            # members changed, or a member moved on other than by this path's one step (a
            # speculative step, a preemption): rebuilt, never guessed
            self._rebuild(reqs)
        else:
            self._advance(pos)
        self._pos = pos
        self.ids[:b].copy_(torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long))
        n = self.padded
        return self.ids[:n], self.positions[:n], self.tables[:n, :self.width], self.slots[:n]

    def bucket(self, b: int) -> int:
        """Rows a step of `b` sequences runs with: the smallest bucket that holds them (`b`
        when unbucketed or past the last bucket)."""
        return next((x for x in self.buckets if x >= b), b)

    def _columns(self, need: int) -> int:
        """Table columns for a longest table of `need` blocks (a power of two when bucketed)."""
        return 1 << (need - 1).bit_length() if self.buckets else need

    def _pad(self, b: int) -> None:
        """Rows b..padded-1 as pad rows (token 0 at position 0 in the pad block and slot)."""
        n = self.padded
        if n == b:
            return
        self.ids[b:n] = 0
        self.positions[b:n] = 0
        if self.cache.pad_slot is not None:
            self.slots[b:n] = self.cache.pad_slot
        if self.has_kv:
            self.tables[b:n] = self.cache.pad_block

    def _rebuild(self, reqs: list[Request]) -> None:
        self.rebuilds += 1
        self.rows = list(reqs)
        b = len(reqs)
        self.padded = self.bucket(b) if b else 0
        if self.padded > self.ids.shape[0]:  # more sequences than max_num_seqs (forked samples)
            n = self.padded
            self.ids, self.positions, self.slots = (t.new_zeros(n) for t in
                                                    (self.ids, self.positions, self.slots))
            self.tables = self.tables.new_zeros(n, self.tables.shape[1])
        if not b:
            self.width = 0
            return
        pos = [r.num_computed for r in reqs]
        self.positions[:b].copy_(torch.tensor(pos, dtype=torch.long))
        self.slots[:b].copy_(torch.tensor([self.cache.slot(r.id) for r in reqs],
                                          dtype=torch.long))
        if not self.has_kv:
            self.width = 1
            self._pad(b)
            return
        need = [p // self.tpb + 1 for p in pos]
        self.width = self._columns(max(need))
        self._fit(self.width)
        rows = []
        for r, n in zip(reqs, need, strict=True):
            bt = self.cache.block_table(r.id)[:n]
            rows.append(bt + [bt[0]] * (self.width - len(bt)))  # pad: only read as masked keys
        self.tables[:b, :self.width].copy_(torch.tensor(rows, dtype=torch.long))
        self._pad(b)

    def _advance(self, pos: list[int]) -> None:
        """Every row one position on (to `pos`, as the host knows them: the buffers are not
        read back): a row whose position starts a new block gets it."""
        b = len(self.rows)
        self.positions[:b] += 1
        if not self.has_kv:
            return
        for i in [i for i, p in enumerate(pos) if p % self.tpb == 0]:
            col = pos[i] // self.tpb
            if col >= self.width:  # new columns: every row's padding (its column 0) first
                cols = self._columns(col + 1)
                self._fit(cols)
                self.tables[:self.padded, self.width:cols] = self.tables[:self.padded, :1]
                self.width = cols
            self.tables[i, col] = self.cache.block_table(self.rows[i].id)[col]

    def _fit(self, cols: int) -> None:
        if cols > self.tables.shape[1]:
            grown = self.tables.new_zeros(self.tables.shape[0], max(cols, 2 * self.tables.shape[1]))
            grown[:, :self.tables.shape[1]] = self.tables
            self.tables = grown
