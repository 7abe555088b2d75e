"""One speculative decode step of the engine: draft, verify, accept, roll back, emit.

    draft      K_r greedy MTP drafts per request that can speculate (drafter.py)
    verify     [last token, d_1..d_K_r] of every decoding request in one target forward
               (verify.py; a request that does not speculate has one row: plain decode)
    accept     greedy: d_{j+1} is kept while it equals the target's argmax at row j; the
               target's argmax after the last kept draft is emitted too (temperature > 0:
               the target's own (seed, position) draws, rejection.py)
    emit       token by token until EOS, a stop token or a length limit: E tokens
    roll back  the recurrent state of position n+E-1 (on the kernels the live slot holds
               row 0's, so only E >= 2 copies scratch row E-2; elsewhere scratch row E-1
               unless all rows were kept), num_computed = n+E; attention KV past it is
               simply overwritten later

K_r = min(K, tokens the request may still emit - 1), so a step never writes past the
blocks admission reserved and never drafts what max_tokens would cut.

A step in which no request drafts (more than `max_batch` requests decode, or none may emit
two more tokens) is plain decode (`_plain_step`): the target's own decode forward, its
sampler, no verify pass; the head only keeps the step's hiddens pending, and on the kernels
writes their entries when something reads them (a later draft, a decode-end snapshot).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from baton.config.speculative import TreeConfig
from baton.engine.request import Request, RequestOutput
from baton.engine.sampler import greedy_ids
from baton.engine.speculative import kernel_verify
from baton.engine.speculative.drafter import Drafter, DraftJob, Pending
from baton.engine.speculative.hidden import HiddenCache
from baton.engine.speculative.pending import PendingRows, tokens
from baton.engine.speculative.rejection import accept_sampled
from baton.engine.speculative.tree import accept_greedy, relocate
from baton.engine.speculative.verify import StateScratch, VerifyRow, verify_forward
from baton.errors import InvalidRequestError
from baton.model.layers.linear import MAX_PACKED_ROWS, half_weights

log = logging.getLogger("baton.engine")


class SpeculativeDecoder:
    def __init__(self, model, pools, k: int, max_requests: int, first_slot: int,
                 tree: TreeConfig | None = None, max_batch: int = 0):
        self.model, self.pools, self.k = model, pools, k
        self.tree = tree
        """Tree drafts for greedy requests (tree.py), None: chains."""
        # a pipeline's head runs on its last stage (baton/engine/pipeline/speculative.py)
        self.drafter = model.drafter() if model.capabilities.staged else Drafter(model, pools)
        self.scratch = StateScratch(pools, first_slot, max_requests,
                                    tree.max_nodes if tree is not None else k)
        self.pending = PendingRows(model.config.hidden_size)
        """Per speculating request: target hiddens whose MTP entries are still to write."""
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_hist = [0] * (k + 1)
        """Steps (per request that drafted) by drafts accepted, 0..K."""
        self.last_hidden = HiddenCache()
        """Last hidden state of recent decode-end snapshots, by their tokens."""
        self.max_batch = max_batch
        """Draft only while at most this many requests decode in a step (0: always)."""
        self.seconds = {"draft": 0.0, "verify": 0.0, "accept": 0.0}
        """Where the decode steps' time went: MTP passes (pending entries and drafts), the
        target's verify forward, acceptance and the roll back (slot copies, KV moves)."""
        self.steps = 0
        self.plain = model.capabilities.decode_hidden and not model.capabilities.staged
        """Steps without drafts run the target's plain decode forward (`_plain_step`), not a
        verify pass (a pipeline's stages run their verify pass either way)."""
        self._live_first_ok = self.plain and kernel_verify.all_fit(model, pools)
        self._live_first = False
        """Whether the last verify pass kept its chains' first-row states in the live slots
        (`VerifyPlan.live_first`: the kernel path of a colocated engine)."""
        self.half_weights = (model.capabilities.staged or not isinstance(model, nn.Module)
                             or half_weights(model))
        """Linear weights stored in half precision: off the fast path their verify passes
        keep to MAX_PACKED_ROWS rows (`_fit_rows`). A pipeline's stages (and a model that
        is no module here) cast their weights in their own processes: kept capped."""

    def on_fast_path(self) -> bool:
        """Whether this engine's steps may run on the fast decode path: its verify passes,
        chains and trees, then equal plain fast decode (kernel_verify). A pipeline's other
        stages decide the same for their own layers (same machine, same kernels)."""
        return kernel_verify.applies(self.pools, self.tree is not None)

    def wants(self, req: Request) -> bool:
        """Whether `req` speculates: a request decoding here (not a prefill-only handoff),
        greedy ones by argmax, others by the rejection rule (rejection.py). One whose draw
        needs the processed distribution of every position (penalties, logit_bias,
        min_tokens) or its logprobs decodes one token a step through the sampler instead. A
        grammar's request drafts: its verify rows are masked under the drafts before them
        (`Grammars.mask_drafts`)."""
        s = req.sampling
        return not req.prefill_only and not s.penalized and s.logprobs is None

    def kv_wanted(self, req: Request) -> bool:
        """Whether a prefill chunk of `req` writes the head's KV: when it speculates here, or
        when that KV ships with the prompt's (a prefill-only handoff)."""
        return self.wants(req) or self.drafter.shared

    @property
    def draft_layers(self) -> tuple[int, ...]:
        """Global ids of the head's attention layers (in the target's pool when shared)."""
        return self.drafter.head.attention_layers if self.drafter.shared else ()

    def forget(self, request_id: str) -> None:
        self.pending.forget(request_id)

    @property
    def tracked(self) -> int:
        return len(self.pending)

    # ---- prefill -----------------------------------------------------------------------
    def prefill_inputs(self, group: list[tuple[Request, int]], cache) -> list | None:
        """Before a prefill group's forward: per sequence the tokens after its chunk's
        positions (what the head reads beside the chunk's hiddens), None for one whose head
        KV is not wanted; None when no sequence wants it. A first chunk after a hit on a
        decode-end snapshot writes the entry that lags there first (`resume_entry`)."""
        out = []
        for req, end in group:
            if not self.kv_wanted(req):
                out.append(None)
                continue
            if req.num_computed == req.cached_tokens > 0:  # its first chunk after a hit
                self.resume_entry(req, cache)
            nxt = req.prompt_ids[req.num_computed + 1 : end + 1]
            if end >= req.prompt_len:  # the token after the prompt is not drawn yet
                nxt = nxt + [0]
            out.append(nxt)
        return out if any(n is not None for n in out) else None

    def after_prefill(self, group: list[tuple[Request, int]], nexts: list, hidden,
                      cache) -> None:
        """The head's KV for a prefill group's chunk (hidden [n, T, H], `nexts` from
        `prefill_inputs`; a pipeline wrote it in the forward and gives [n, 1, H]); the last
        chunk leaves its last hidden pending for the first draft."""
        idx = [i for i, n in enumerate(nexts) if n is not None]
        for i in idx:
            req, end = group[i]
            if end >= req.prompt_len and self.wants(req):
                self.pending[req.id] = Pending(end - 1, hidden[i, -1:].clone())
        if self.drafter.in_forward:
            return
        sel = hidden if len(idx) == len(group) else hidden[idx]
        self.drafter.prefill(sel, [nexts[i] for i in idx],
                             [group[i][0].num_computed for i in idx],
                             [cache.block_table(group[i][0].id) for i in idx])

    # ---- decode ------------------------------------------------------------------------
    def num_drafts(self, req: Request, max_model_len: int) -> int:
        """Draft rows of `req` this step: K (a tree: its node budget), never more than it
        may still emit - 1."""
        if not self.wants(req) or req.id not in self.pending:
            return 0
        out, s = len(req.output_ids), req.sampling
        remaining = min(s.max_tokens - out, max_model_len - req.prompt_len - out)
        rows = self.tree.max_nodes if self.tree is not None and s.greedy else self.k
        return max(0, min(rows, remaining - 1))

    def step(self, engine, reqs: list[Request], failed: list[RequestOutput]):
        """Decode `reqs` once; returns (sampled: [(request, logits)] for the engine's sampler,
        outputs of the requests decided here)."""
        # a compute-bound batch (more than max_batch requests) verifies K+1 rows each for
        # about K+1 times a plain step: it decodes without drafts
        drafting = not self.max_batch or len(reqs) <= self.max_batch
        if not drafting and self.plain:  # no request drafts: as plain decode's step
            reqs = [r for r in reqs if engine._guarded(r, failed, engine.cache.ensure_blocks,
                                                        r.id, r.num_computed + 1)]
            return (self._plain_step(engine, reqs, failed) if reqs else []), []
        ks = {r.id: self.num_drafts(r, engine.max_model_len) if drafting else 0 for r in reqs}
        if self.half_weights and not self.on_fast_path():
            _fit_rows(reqs, ks)
        reqs = [r for r in reqs if engine._guarded(r, failed, engine.cache.ensure_blocks, r.id,
                                                    r.num_computed + ks[r.id] + 1)]
        if not reqs:
            return [], []
        if self.plain and not any(ks[r.id] for r in reqs):
            return self._plain_step(engine, reqs, failed), []
        # every request with pending entries writes them, drafting or not (none may be left
        # from drafts: a snapshot and the next drafts read them)
        t0 = time.perf_counter()
        drafts = self._draft(engine, [r for r in reqs if r.id in self.pending], ks)
        t1 = time.perf_counter()
        self.seconds["draft"] += t1 - t0
        cache = engine.cache
        rows = []
        for r in reqs:
            d = drafts.get(r.id)
            tokens, parents = (d.tokens, tuple(d.parents)) if self.tree is not None and d \
                else (d or [], ())
            rows.append(VerifyRow([r.output_ids[-1], *tokens], r.num_computed,
                                  cache.slot(r.id), cache.block_table(r.id), parents))
        try:
            hidden, logits = self._verify(rows)
        except Exception as e:  # noqa: BLE001 - fails this forward's requests only
            log.exception("verify forward of %d requests failed", len(reqs))
            failed.extend(engine._fail(r, f"decode forward failed: {e}") for r in reqs)
            return [], []
        t2 = time.perf_counter()
        self.seconds["verify"] += t2 - t1
        out = self._accept(engine, reqs, rows, hidden, logits, failed)
        self.seconds["accept"] += time.perf_counter() - t2
        self.steps += 1
        return out

    def _plain_step(self, engine, reqs: list[Request], failed: list[RequestOutput]):
        """A step in which no request drafts (the batch is over `max_batch`, or no request
        may emit two more tokens): the target's plain decode forward, exactly speculation
        off's (no verify pass, no slot copies), whose hiddens become the requests' next
        pending rows; the engine's sampler draws the tokens (a draw with no drafts is the
        sampler's own draw, as the rejection rule's bonus token is). Returns [(request,
        logits)].

        The pending entries are written only when something reads them (`_lazy`): the
        request's next draft (its first pass), its decode-end snapshot (`_settle`), or when
        its pending rows reach their bound (pending.py); a request that finishes without
        either never pays for them. Elsewhere (`_lazy` false) they are written here first (only what
        they need, `Drafter.write`)."""
        lazy = self._lazy()
        t0 = time.perf_counter()
        if lazy:  # only requests whose rows reached the bound
            over = self.pending.over
            full = [r for r in reqs if r.id in over] if over else []
        else:
            full = [r for r in reqs if r.id in self.pending]
        self._write_pending(engine, full)
        for r in full:
            del self.pending[r.id]
        t1 = time.perf_counter()
        self.seconds["draft"] += t1 - t0
        hidden: list[torch.Tensor] = []
        try:
            logits = engine._decode(reqs, hidden)
        except Exception as e:  # noqa: BLE001 - fails this forward's requests only
            log.exception("decode forward of %d requests failed", len(reqs))
            failed.extend(engine._fail(r, f"decode forward failed: {e}") for r in reqs)
            return []
        self.seconds["verify"] += time.perf_counter() - t1
        wants = self.wants
        self.pending.append_rows([(r.id, r.num_computed - 1, i) for i, r in enumerate(reqs)
                                  if wants(r)], hidden[0])
        self.steps += 1
        return list(zip(reqs, logits, strict=True))

    def _lazy(self) -> bool:
        """Whether pending entries may wait for their reader: on the kernels only, where an
        entry's bits do not depend on the batch it is written in (`kernel_verify`); on the
        reference path each step writes its own, in the batches it always had."""
        return self.plain and kernel_verify.applies(self.pools)

    def _write_pending(self, engine, reqs: list[Request]) -> None:
        """The head's entries of `reqs`' pending rows, nothing else (no drafts)."""
        if not reqs:
            return
        jobs = [DraftJob(p, tokens(r, p.start + 1, p.start + 1 + p.hidden.shape[0]),
                         engine.cache.block_table(r.id), 0)
                for r in reqs for p in (self.pending[r.id],)]
        try:
            self.drafter.write(jobs)
        except Exception:  # noqa: BLE001 - only acceptance is the worse for a stale entry
            log.exception("writing the MTP KV of %d requests failed", len(jobs))

    def _verify(self, rows: list[VerifyRow]):
        tree = self.tree is not None
        self._live_first = False
        if self.model.capabilities.staged:  # a pipeline: every stage runs its layers
            return self.model.verify(rows, self.scratch, tree)
        self._live_first = self._live_first_ok and not tree and \
            kernel_verify.applies(self.pools)
        return verify_forward(self.model, self.pools, rows, self.scratch, tree,
                              self._live_first)

    def _draft(self, engine, reqs: list[Request], ks: dict[str, int]) -> dict[str, list[int]]:
        if not reqs:
            return {}
        jobs = []
        for r in reqs:
            p = self.pending[r.id]
            nxt = tokens(r, p.start + 1, p.start + 1 + p.hidden.shape[0])
            jobs.append(DraftJob(p, nxt, engine.cache.block_table(r.id), ks[r.id],
                                 engine.grammars.draft_mask(r) if r.sampling.grammar else None))
        try:
            if self.tree is not None:  # greedy requests a tree, sampled ones a chain
                depth = self.tree.depth
                out = self.drafter.draft_tree(jobs, [
                    self.tree.top_k if r.sampling.greedy else (1,) * depth for r in reqs])
                return {r.id: t for r, t in zip(reqs, out, strict=True) if t.tokens}
            out = self.drafter.draft(jobs)
        except Exception:  # noqa: BLE001 - drafts are optional: verify the last token alone
            log.exception("MTP drafting of %d requests failed; decoding without drafts",
                          len(reqs))
            return {}
        return {r.id: d for r, d in zip(reqs, out, strict=True) if d}

    def _candidates(self, engine, r: Request, row: VerifyRow, lg,
                    target: list[int]) -> tuple[list[int], list]:
        """(the tokens verification keeps: accepted drafts, then one target token; the rows
        they follow, root first). `target`: the argmax of each of the request's rows."""
        drafts = row.tokens[1:]
        if not r.sampling.greedy:
            cand = accept_sampled(engine.sampler, r.id, r.sampling, lg, drafts, row.start + 1)
            return cand, list(range(len(cand)))
        if row.parents:  # a tree: follow the target's argmax from the root
            path = accept_greedy(list(row.parents), drafts, target)
            return [target[p] for p in path], path
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        return target[: a + 1], list(range(a + 1))

    def _accept(self, engine, reqs, rows, hidden, logits, failed):
        sampled, kept = [], []
        argmax = greedy_ids(logits).tolist()  # one call for every row (greedy acceptance)
        off = 0
        for i, (r, row) in enumerate(zip(reqs, rows, strict=True)):
            m = len(row.tokens)
            lg, hd = logits[off : off + m], hidden[off : off + m]
            target = argmax[off : off + m]
            off += m
            if not self.wants(r):
                r.num_computed += 1
                sampled.append((r, lg[0]))
                continue
            if r.sampling.grammar:  # each row masked under the drafts before it
                try:
                    lg = engine.grammars.mask_drafts(lg, r, row.tokens[1:], row.parents)
                except InvalidRequestError as ex:
                    failed.append(engine._fail(r, str(ex)))
                    continue
                target = greedy_ids(lg).tolist()
            try:
                cand, path = self._candidates(engine, r, row, lg, target)
            except (ValueError, RuntimeError) as ex:
                failed.append(engine._fail(r, f"sampling failed: {ex}"))
                continue
            a = len(cand) - 1
            toks = _emit(engine, r, cand)
            e = len(toks)
            if self.tree is not None:  # kept rows' KV to their positions, the last's state
                path = path[:e]
                relocate(self.pools, row.table, row.start, path)
                if path[-1]:
                    self.scratch.restore(i, path[-1] - 1, row.slot)
                hd = hd.index_select(0, torch.tensor(path, device=hd.device))
            elif self._live_first:  # the live slot holds row 0's state, scratch j-1 row j's
                if e > 1:
                    self.scratch.restore(i, e - 2, row.slot)
            elif e < m:  # the live slot holds the state after all m rows: take row e-1's
                self.scratch.restore(i, e - 1, row.slot)
            r.num_computed = row.start + e
            self.draft_tokens += m - 1
            self.accepted_tokens += a
            r.draft_tokens += m - 1
            r.accepted_tokens += a
            if m > 1:
                self.accepted_hist[a] += 1
            # a finished request's rows stay pending until its decode-end snapshot settles
            # them (`feed_last`) or it is forgotten
            self.pending[r.id] = Pending(row.start, hd[:e])
            kept.append((r, toks))
        done = [r for r, _ in kept if r.finish_reason is not None]
        if done:  # after the roll back: a decode-end snapshot must see the kept state
            engine._finish(done)
        outs = [engine._output(r, tuple(t), finished=r.finish_reason is not None)
                for r, t in kept]
        return sampled, outs


    # ---- the lagging entry of a decode-end snapshot --------------------------------------
    def feed_last(self, engine, reqs: list[Request]) -> None:
        """`Engine._decode` for the decode-end snapshot (the last token fed; verify rows of
        one position are plain decode), keeping each request's last hidden state: the next
        turn, which hits that snapshot, writes the head's entry there with its own token."""
        if self.drafter.shared:
            self._settle(engine, [r for r in reqs if r.id in self.pending])
        cache = engine.cache
        if self.plain:
            out: list[torch.Tensor] = []
            engine._decode(reqs, out)
            hidden = out[0]
        else:
            for r in reqs:
                cache.ensure_blocks(r.id, r.num_computed + 1)
            rows = [VerifyRow([r.output_ids[-1]], r.num_computed, cache.slot(r.id),
                              cache.block_table(r.id)) for r in reqs]
            hidden, _ = self._verify(rows)
            for r in reqs:
                r.num_computed += 1
        for r, h in zip(reqs, hidden, strict=True):
            if self.drafter.shared:
                self.last_hidden.put(r.all_ids[: r.num_computed], h.clone())

    def resume_entry(self, req: Request, cache) -> None:
        """A request that starts on a decode-end snapshot of c tokens: the head's entry c-1
        (it pairs the snapshot's last hidden with the token after it) is written now, with
        this request's token c, before its first chunk's entries read it."""
        c = req.num_computed
        h = self.last_hidden.get(req.prompt_ids[:c]) if 0 < c < req.prompt_len else None
        if h is not None:
            self.drafter.write([DraftJob(Pending(c - 1, h[None]), [req.prompt_ids[c]],
                                         cache.block_table(req.id), 0)])

    def _settle(self, engine, done: list[Request]) -> None:
        """Finished requests whose decode-end snapshot keeps the head's KV: write their
        pending entries, rewriting those the last drafts wrote from unverified inputs with
        the kept positions' target hiddens (the snapshot never holds draft state; its last
        entry lags one token, like a prompt's)."""
        jobs = [DraftJob(p, tokens(r, p.start + 1, r.num_computed + 1),
                         engine.cache.block_table(r.id), 0)
                for r in done for p in (self.pending[r.id],)]
        if not jobs:
            return
        try:
            self.drafter.write(jobs)
        except Exception:  # noqa: BLE001 - only the snapshot's draft KV is the worse for it
            log.exception("settling the MTP KV of %d finished requests failed", len(jobs))


def _fit_rows(reqs: list[Request], ks: dict[str, int]) -> None:
    """Fewer drafts (the most first) until the verify pass has at most MAX_PACKED_ROWS rows,
    when plain decode of the batch would have at most that many: half-precision weights
    (`model.weight_dtype`) take Baton's kernel for up to that many rows on the reference
    path, and larger matmuls an upcast copy on MKL, which rounds differently; within one
    kernel a row's bits do not depend on the row count, so the verify pass equals plain
    decode again. Only such an engine calls it (`step`): on the fast path the kernel takes
    every row count (`kernel_verify`), and float32 weights take MKL at every row count on
    the reference path."""
    if len(reqs) > MAX_PACKED_ROWS:
        return
    extra = len(reqs) + sum(ks.values()) - MAX_PACKED_ROWS
    for _ in range(max(0, extra)):
        rid = max(ks, key=ks.get)
        ks[rid] -= 1


def _emit(engine, req: Request, toks: list[int]) -> list[int]:
    """Append `toks` until one finishes the request; the tokens kept."""
    now = time.monotonic()
    kept = []
    for tok in toks:
        req.output_ids.append(tok)
        kept.append(tok)
        if req.first_token_time is None:
            req.first_token_time = now
        reason = engine._finish_reason(req, tok)
        if reason:
            req.finish_reason = reason
            req.finish_time = now
            break
    return kept
