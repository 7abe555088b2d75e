"""Drafting with the MTP head: its KV over the prompt, then K greedy drafts per decode step.

The head's entry at position i reads the target hidden h_i and the token at i+1, so:

    prefill chunk [s, e)    entries s..e-1 from h_s..h_{e-1} and tokens s+1..e (the last
                            chunk's token e is not known yet: a placeholder, rewritten below)
    pending (start, h)      target hiddens of positions start..n-1 (n = num_computed) whose
                            entries still need the tokens that followed them: the last prompt
                            position after prefill, the kept verify positions after a step
    draft                   first pass over the pending rows (rewriting any entry a rejected
                            draft left); its last row's argmax is draft 1 and its output the
                            hidden of the next pass; passes 2..K: one row per request at n+k-2

Drafts never change what is emitted (the target verifies them); only acceptance depends on
this KV. It lives in the target's KV pool as extra attention layers (global ids after the
target's, `with_draft_layers`), so it shares the request's blocks: prefix sharing, snapshots
and the prefill -> decode transfer carry it with the target's KV. A cached prefix's entry
c-1 is the one the request that computed it wrote (with its own token c); a decode-end
snapshot's, which nobody wrote, is written by the next turn (`resume_entry`). The prefill
worker's entry for the prompt's last position keeps a placeholder token (the first token
is drawn after its forward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from baton.engine.sampler import greedy_ids
from baton.engine.speculative import kernel_verify
from baton.model.layers import fused
from baton.model.layers.linear import decode_scope
from baton.model.paged import StepContext, decode_meta, prefill_meta

JOINT_ROWS = 8
"""Pending rows of a job that its first pass runs whole (the head's layers over every row, in
one call); a job with more writes the entries of all but its last first (`Drafter.write`)."""


class Pending(NamedTuple):
    start: int
    hidden: torch.Tensor
    """[p, H] target hiddens of positions start..start+p-1."""


class DraftJob(NamedTuple):
    pending: Pending
    next_ids: list[int]
    """The tokens at positions start+1..start+p (they follow the pending hiddens)."""
    table: list[int]
    num_drafts: int
    mask: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None
    """A grammar's request: (its drafts so far, a logits row) -> the row masked to what the
    grammar allows after them (chains only; `Grammars.draft_mask`)."""


class Drafter:
    in_forward = False
    """The head's prompt KV is written by `prefill` after the target's forward (a pipeline's
    stand-in writes it inside the forward)."""

    def __init__(self, model, target_pools):
        self.head = model.mtp
        self.embed = model.embedding
        self.lm_head = model.lm_head
        # the head's KV in the target's pool (with_draft_layers), else in a pool of its own
        own = any(x not in target_pools.spec.attn_index for x in self.head.attention_layers)
        self.pools = self.head.make_pools(target_pools.spec) if own else target_pools
        self.shared = not own
        self.device = model.device

    def _longs(self, xs) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def prefill(self, hidden: torch.Tensor, next_ids: list[list[int]], starts: list[int],
                tables: list[list[int]]) -> None:
        """Write the head's KV of a prefill group's chunk: hidden [n, T, H]."""
        T = hidden.shape[1]
        meta = prefill_meta(starts, T, tables, self.pools)
        ctx = StepContext(self.pools, meta, None)
        self.head(hidden, self._longs(next_ids), self.embed, self.lm_head, ctx, decode=False,
                  logits=False)

    def _rows(self, hidden, next_ids, positions, tables, logits: bool = True):
        with decode_scope():  # few rows: decode's kernels (lean metadata where they read it)
            meta = decode_meta(self._longs(positions), tables, self.pools,
                               lean=fused.kernel_attention(self.pools))
            ctx = StepContext(self.pools, meta, None)
            return self.head(hidden, self._longs(next_ids), self.embed, self.lm_head, ctx,
                             decode=True, logits=logits)

    def _first_pass(self, jobs: list[DraftJob]):
        """The pending rows of every job (their entries written); (the last row's output per
        job, float32 logits of it per job that drafts, zeros for the others): the LM head
        runs on those rows only. On the kernels (`kernel_verify.applies`: a row's bits do not
        depend on its batch) a job with more than JOINT_ROWS rows (steps without drafts left
        them pending) writes only the entries of the rows before its last (`write`); fewer
        (a verify step's kept rows) go through the pass with the last, in one call."""
        if any(len(j.next_ids) > JOINT_ROWS for j in jobs) and \
                kernel_verify.applies(self.pools):
            self.write([DraftJob(Pending(j.pending.start, j.pending.hidden[:-1]),
                                 j.next_ids[:-1], j.table, 0)
                        for j in jobs if len(j.next_ids) > JOINT_ROWS])
            jobs = [DraftJob(Pending(j.pending.start + len(j.next_ids) - 1,
                                     j.pending.hidden[-1:]), j.next_ids[-1:], j.table,
                             j.num_drafts) if len(j.next_ids) > JOINT_ROWS else j
                    for j in jobs]
        hid = torch.cat([j.pending.hidden for j in jobs]) if len(jobs) > 1 \
            else jobs[0].pending.hidden
        ids = [t for j in jobs for t in j.next_ids]
        pos = [j.pending.start + i for j in jobs for i in range(len(j.next_ids))]
        out, _ = self._rows(hid, ids, pos, [j.table for j in jobs for _ in j.next_ids],
                            logits=False)
        if len(ids) == len(jobs):  # one row a job (always on the kernels): no gather
            g = out
        else:
            g = out.index_select(0, torch.cumsum(self._longs([len(j.next_ids) for j in jobs]),
                                                 0) - 1)
        want = [i for i, j in enumerate(jobs) if j.num_drafts]
        if len(want) == len(jobs):
            with decode_scope():
                return g, self.lm_head(g).float()
        logits = torch.zeros(len(jobs), self.lm_head.weight.shape[0], device=g.device)
        if want:
            sel = self._longs(want)
            with decode_scope():
                logits.index_copy_(0, sel, self.lm_head(g.index_select(0, sel)).float())
        return g, logits

    def write(self, jobs: list[DraftJob]) -> None:
        """Only the first pass's entries (verified hiddens and tokens), no drafts: a step
        without drafts, what a finished request leaves for its decode-end snapshot. A head
        with `write_kv` computes only what the entries need (no query, attention, later
        layers or LM head), the same bits as its full pass over these rows."""
        hid = torch.cat([j.pending.hidden for j in jobs]) if len(jobs) > 1 \
            else jobs[0].pending.hidden
        ids = [t for j in jobs for t in j.next_ids]
        pos = [j.pending.start + i for j in jobs for i in range(len(j.next_ids))]
        with decode_scope():
            meta = decode_meta(self._longs(pos), [j.table for j in jobs for _ in j.next_ids],
                               self.pools, lean=fused.kernel_attention(self.pools))
            ctx = StepContext(self.pools, meta, None)
            self.head.write_kv(hid, self._longs(ids), self.embed, ctx)

    def draft(self, jobs: list[DraftJob]) -> list[list[int]]:
        """Greedy drafts of each job; a job with num_drafts 0 only has its pending entries
        written (a request that may emit one more token: nothing to draft)."""
        g, first = self._first_pass(jobs)
        tok = greedy_ids(_masked(jobs, range(len(jobs)), first, [[] for _ in jobs]))
        drafts = [[t] if j.num_drafts else [] for j, t in zip(jobs, tok.tolist(), strict=True)]
        for k in range(2, max(j.num_drafts for j in jobs) + 1):
            live = [i for i, j in enumerate(jobs) if j.num_drafts >= k]
            every = len(live) == len(jobs)  # no gather, no scatter
            sel = None if every else self._longs(live)
            # the entry at n+k-2 pairs the previous pass's output with draft k-1
            pos = [jobs[i].pending.start + len(jobs[i].next_ids) + k - 2 for i in live]
            out, logits = self._rows(g if every else g.index_select(0, sel),
                                     [drafts[i][-1] for i in live], pos,
                                     [jobs[i].table for i in live])
            g = out if every else g.index_copy(0, sel, out)
            logits = _masked(jobs, live, logits, drafts)
            for i, t in zip(live, greedy_ids(logits).tolist(), strict=True):
                drafts[i].append(t)
        return drafts

    def draft_tree(self, jobs: list[DraftJob], top_k: list[tuple[int, ...]]) -> list:
        """Tree drafts (tree.py) of each job: `num_drafts` is its node budget, top_k[i] its
        children per node at each depth (all 1: a chain). Returns a `Tree` per job."""
        from baton.engine.speculative.tree import Tree, path, path_meta

        g0, first = self._first_pass(jobs)
        trees = [Tree([], []) for _ in jobs]
        n = [j.pending.start + len(j.next_ids) for j in jobs]
        score = [[0.0] for _ in jobs]  # summed log-probability of each row (root 0)
        # frontier: (job, row, output hidden row of its pass, log-probs of its children)
        lp = torch.log_softmax(first, -1)
        frontier = [(i, 0, g0[i], lp[i]) for i in range(len(jobs))]
        depth = 0
        while frontier:
            depth += 1
            grown = []
            for i in sorted({f[0] for f in frontier}):
                j, ks = jobs[i], top_k[i]
                room = j.num_drafts - len(trees[i].tokens)
                if depth > len(ks) or room <= 0:
                    continue
                cands = []
                for _, row, g, lps in (f for f in frontier if f[0] == i):
                    top = torch.topk(lps, ks[depth - 1])
                    cands += [(score[i][row] + v, row, t, g) for v, t in
                              zip(top.values.tolist(), top.indices.tolist(), strict=True)]
                cands.sort(key=lambda c: -c[0])  # stable: ties keep parent, then rank order
                for s, row, t, g in cands[:room]:
                    trees[i].tokens.append(t)
                    trees[i].parents.append(row)
                    score[i].append(s)
                    grown.append((i, len(trees[i].tokens), g))
            # one head pass over the new nodes that may still have children
            grown = [x for x in grown if depth < len(top_k[x[0]])
                     and jobs[x[0]].num_drafts > len(trees[x[0]].tokens)]
            if not grown:
                break
            paths = [[n[i] - 1 + q for q in path(trees[i].parents, r)[1:]] for i, r, _ in grown]
            meta = path_meta([n[i] for i, _, _ in grown], paths,
                             [n[i] - 1 + r for i, r, _ in grown],
                             [n[i] + depth - 1 for i, _, _ in grown],
                             [jobs[i].table for i, _, _ in grown], self.pools)
            with decode_scope():
                g_out, lg = self.head(torch.stack([g for _, _, g in grown]),
                                      self._longs([trees[i].tokens[r - 1] for i, r, _ in grown]),
                                      self.embed, self.lm_head,
                                      StepContext(self.pools, meta, None), decode=True)
            lps = torch.log_softmax(lg, -1)
            frontier = [(i, r, g_out[x], lps[x]) for x, (i, r, _) in enumerate(grown)]
        return trees


def _masked(jobs: list[DraftJob], rows, logits: torch.Tensor,
            drafts: list[list[int]]) -> torch.Tensor:
    """`logits` (row r: job rows[r]) with the rows of grammar-constrained jobs masked under
    their drafts so far (a copy when any is)."""
    out = logits
    for r, i in enumerate(rows):
        if jobs[i].mask is not None and jobs[i].num_drafts:
            if out is logits:
                out = logits.clone()
            out[r] = jobs[i].mask(drafts[i], logits[r])
    return out
