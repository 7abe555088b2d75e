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
thing either way (tests/unit/test_decode_batch.py checks the buffers against a rebuild after
every step of a workload where requests join and leave). Only for models that take a table
tensor (`decode_takes_tables`); pipeline and tensor-parallel models send lists over the wire.
"""

from __future__ import annotations

import torch

from baton.cache.manager import HybridCacheManager
from baton.engine.request import Request


class DecodeBatch:
    def __init__(self, cache: HybridCacheManager, capacity: int, device):
        spec = cache.pools.spec
        self.cache = cache
        self.tpb = spec.tokens_per_block
        self.has_kv = cache.pools.has_kv
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
        """Columns of `tables` the batch's longest sequence needs (`nb`)."""
        self.rebuilds = 0

    def update(self, reqs: list[Request]):
        """(ids, positions, tables [b, nb], slots) of `reqs`' next decode step, each request at
        position `num_computed` reading its last output token; views of the buffers."""
        b = len(reqs)
        pos = [r.num_computed for r in reqs]
        if (b != len(self.rows) or any(a is not r for a, r in zip(reqs, self.rows, strict=True))
                or any(p != q + 1 for p, q in zip(pos, self._pos, strict=True))):
            # members changed, or a member moved on other than by this path's one step (a
            # speculative step, a preemption): rebuilt, never guessed
            self._rebuild(reqs)
        else:
            self._advance()
        self._pos = pos
        self.ids[:b].copy_(torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long))
        return self.ids[:b], self.positions[:b], self.tables[:b, :self.width], self.slots[:b]

    def _rebuild(self, reqs: list[Request]) -> None:
        self.rebuilds += 1
        self.rows = list(reqs)
        b = len(reqs)
        if b > self.ids.shape[0]:  # more sequences than max_num_seqs (forked samples)
            self.ids, self.positions, self.slots = (t.new_zeros(b) for t in
                                                    (self.ids, self.positions, self.slots))
            self.tables = self.tables.new_zeros(b, self.tables.shape[1])
        if not b:
            self.width = 0
            return
        pos = [r.num_computed for r in reqs]
        self.positions[:b].copy_(torch.tensor(pos, dtype=torch.long))
        self.slots[:b].copy_(torch.tensor([self.cache.slot(r.id) for r in reqs],
                                          dtype=torch.long))
        if not self.has_kv:
            self.width = 1
            return
        need = [p // self.tpb + 1 for p in pos]
        self.width = max(need)
        self._fit(self.width)
        rows = []
        for r, n in zip(reqs, need, strict=True):
            bt = self.cache.block_table(r.id)[:n]
            rows.append(bt + [bt[0]] * (self.width - len(bt)))  # pad: only read as masked keys
        self.tables[:b, :self.width].copy_(torch.tensor(rows, dtype=torch.long))

    def _advance(self) -> None:
        """Every row one position on: a row whose position starts a new block gets it."""
        b = len(self.rows)
        pos = self.positions[:b]
        pos += 1
        if not self.has_kv:
            return
        for i in torch.nonzero(pos % self.tpb == 0).flatten().tolist():
            col = int(pos[i]) // self.tpb
            if col >= self.width:  # a new column: every row's padding (its column 0) first
                self._fit(col + 1)
                self.tables[:b, self.width:col + 1] = self.tables[:b, :1]
                self.width = col + 1
            self.tables[i, col] = self.cache.block_table(self.rows[i].id)[col]

    def _fit(self, cols: int) -> None:
        if cols > self.tables.shape[1]:
            grown = self.tables.new_zeros(self.tables.shape[0], max(cols, 2 * self.tables.shape[1]))
            grown[:, :self.tables.shape[1]] = self.tables
            self.tables = grown
