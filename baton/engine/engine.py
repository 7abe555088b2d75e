"""The engine step: schedule -> run the model -> sample -> commit snapshots -> finish.

Both worker roles run this engine: the prefill worker stops each request after its
first token (`Request.prefill_only`) and keeps the cache for the handoff; the decode
worker admits requests whose prompt state arrives by transfer (`reserve_remote`). A request
of n > 1 samples computes its prompt once and then forks into n sequences
(baton/engine/samples.py): after its last prompt chunk, or on the decode worker at
`start_remote` with the n first tokens the prefill worker drew.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import torch

from baton.agents.grammar import Grammars
from baton.cache.manager import HybridCacheManager
from baton.config import WorkerConfig
from baton.contract import FinishReason, TokenLogprob
from baton.contract.limits import check_length, check_pool, check_samples
from baton.engine.decode_batch import DecodeBatch
from baton.engine.logprobs import prompt_logprobs, token_logprobs
from baton.engine.request import Phase, Request, RequestOutput, SamplingParams, sample_id
from baton.engine.sampler import Sampler
from baton.engine.samples import SampleFamilies, fork
from baton.engine.scheduler import Scheduler
from baton.engine.speculative.setup import build_speculative
from baton.errors import CapacityError, InvalidRequestError, TransferError
from baton.model.layers.linear import reference_scope

log = logging.getLogger("baton.engine")


class LayerStream(Protocol):
    """Layer-wise handoff of one prefill request, driven from inside its last chunk's forward
    (on the loop thread): `begin` with the request's complete block table, then
    `layers_done(layers)` as soon as those global layers hold their final KV and state (the
    layers already computed when the stream was picked up come in one call)."""

    def begin(self, block_table: list[int], slot: int | None) -> None: ...

    def layers_done(self, layers: list[int]) -> None: ...


class Engine:
    weights = None
    """`baton.model.quant.served.WeightInfo`: the weight format and bytes served (set by the
    builder; the engine-ready line, Stats, /metrics)."""
    rounding = None
    """`baton.engine.state_rounding.LiveRounding` when the state is stored in fewer bits
    (set by the builder), else None."""

    def __init__(self, model, cache: HybridCacheManager, cfg: WorkerConfig, tokenizer=None,
                 speculative=None):
        self.model = model
        self.cache = cache
        self.pools = cache.pools
        self.cfg = cfg
        self.tokenizer = tokenizer
        mcfg = model.config
        self.max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        self.eos_ids = frozenset(mcfg.eos_token_id)
        self.scheduler = Scheduler(cfg, cache, self.max_model_len)
        self.sampler = Sampler(self.eos_ids)
        self.grammars = Grammars(tokenizer, mcfg.vocab_size, self.eos_ids)
        """Constrained requests' matchers (baton/agents/grammar.py)."""
        self.requests: dict[str, Request] = {}
        mc = cache.cfg.mamba_state_config
        self.decode_end_snapshot = cache.reuse_enabled and mc.decode_end_snapshot
        self.device = self.pools.spec.device
        self._streams: dict[str, LayerStream] = {}
        """Layer streams not picked up yet, by request id; any thread adds, under the lock."""
        self._streams_lock = threading.Lock()
        self.spec = build_speculative(model, self.pools, speculative, cfg.max_num_seqs,
                                      getattr(cache, "reserved_slots", 0))
        """MTP speculative decoding (baton/engine/speculative/), None when off."""
        self.batch = (DecodeBatch(cache, cfg.max_num_seqs, self.device,
                                  cfg.decode_batch_buckets if pads(cache) else ())
                      if model.capabilities.decode_takes_tables else None)
        """The plain decode step's metadata tensors (baton/engine/decode_batch.py); None for
        models that take lists (pipeline, tensor parallel)."""
        if cfg.decode_batch_buckets and not pads(cache):
            log.warning("worker.decode_batch_buckets ignored: %s decodes from lists (pipeline "
                        "and tensor-parallel workers)", type(model).__name__)
        self.samples = SampleFamilies()
        """Requests forked into their n samples (baton/engine/samples.py)."""
        self.prefilled_tokens = 0
        """Prompt tokens this engine computed (chunks committed), for Stats and metrics: on a
        decode worker, the increments it prefilled itself (conditional disaggregation)."""

    # ---- admission -------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], sampling: SamplingParams,
                 forks: bool = True) -> None:
        """InvalidRequestError for what this engine can never run; `forks`: it will hold the
        request's n samples (not a prefill worker, which draws n first tokens and no more)."""
        vocab = self.model.config.vocab_size
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: send at least one token")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        sampling.validate(vocab)
        self.grammars.prepare(sampling.grammar)  # compiled already where the request came in
        if sampling.prompt_logprobs is not None and \
                not self.model.capabilities.scores_every_position:
            raise InvalidRequestError(
                "prompt_logprobs (echo with logprobs) is not available on a pipeline-parallel "
                "worker; serve it with pipeline_parallel_size 1 or leave it out")
        check_length(len(prompt_ids), sampling.max_tokens, self.max_model_len)
        if self.pools.has_kv:  # as Scheduler.blocks_needed counts, for either role
            spec = self.pools.spec
            check_pool(len(prompt_ids) + sampling.max_tokens, spec.tokens_per_block,
                       spec.num_blocks)
        if sampling.n > 1 and forks:
            if self.spec is not None:
                raise InvalidRequestError(
                    f"n={sampling.n}: several samples are not available with speculative "
                    "decoding on this worker; send n = 1 or serve without speculative")
            spec = self.pools.spec
            check_samples(sampling.n, len(prompt_ids), sampling.max_tokens, self.max_model_len,
                          self.cache.max_live, spec.tokens_per_block,
                          spec.num_blocks if self.pools.has_kv else 0)

    def add_request(self, req: Request) -> None:
        if req.id in self.requests:
            raise InvalidRequestError(f"request id {req.id!r} is already in use")
        self.validate(req.prompt_ids, req.sampling, forks=not req.prefill_only)
        if self.rounding is not None:
            req.round_points = self.rounding.points(req.prompt_len)
        self.requests[req.id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Drop a request (every one of its samples) wherever it is and free what it holds;
        False if unknown."""
        found = self._abort_one(request_id)
        for i in self.samples.pop(request_id):
            found = self._abort_one(sample_id(request_id, i)) or found
        return found

    def abort_sample(self, request_id: str, sample: int) -> int | None:
        """Drop one running sample of a forked request (its siblings go on); the samples
        still open after it, or None when that sample is not running (then nothing changed)."""
        if not self.samples.is_open(request_id, sample):
            return None
        self._abort_one(sample_id(request_id, sample))
        return self.samples.close(request_id, sample)

    def _abort_one(self, request_id: str) -> bool:
        self.take_stream(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        if req.holds_cache:
            self.cache.abort(request_id)
        self.cache.cancel_restore(request_id)
        self._forget(request_id)
        return True

    def quarantine(self, request_id: str, key: str, blocks: list[int], keep_slot: bool) -> bool:
        """Drop a reserved request whose transfer failed, keeping `blocks` and (if `keep_slot`)
        its slot out of service under `key` until `cache.release_quarantine(key)`: bytes of
        that transfer may still land there. False if unknown."""
        self.take_stream(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        if req.holds_cache:
            self.cache.quarantine(request_id, blocks, keep_slot, key)
        self._forget(request_id)
        return True

    def _forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        self.grammars.forget(request_id)
        if self.spec is not None:
            self.spec.forget(request_id)

    def tracked(self) -> dict[str, int]:
        """Per-request bookkeeping besides `requests`: sampler generators, layer streams."""
        with self._streams_lock:
            streams = len(self._streams)
        out = {"sampler_generators": self.sampler.tracked, "layer_streams": streams,
               "sample_families": len(self.samples), "grammar_matchers": self.grammars.tracked}
        if self.spec is not None:
            out["spec_pending"] = self.spec.tracked
        if self.cache.tiers is not None:
            out["tier_restores"] = self.cache.restores_waiting
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def has_ready_work(self) -> bool:
        """Work a step can do now: not when every request waits for a tier read (the read's
        end wakes the loop: `cache.tiers.on_ready`)."""
        s = self.scheduler
        return bool(s.running) or any(not self.cache.restore_pending(r.id) for r in s.waiting)

    # ---- disaggregation ----------------------------------------------------------------
    def reserve_remote(self, req: Request):
        """Decode side: hold blocks and a live slot for a prompt whose state arrives by transfer."""
        self.validate(req.prompt_ids, req.sampling)
        if req.id in self.requests:
            raise InvalidRequestError(f"request id {req.id!r} is already in use")
        n = req.sampling.n
        if len(self.scheduler.running) + self._num_reserved() + n > self.cfg.max_num_seqs:
            raise CapacityError(f"decode worker is full ({self.cfg.max_num_seqs} requests)")
        need = self.scheduler.blocks_needed(req)
        if need and not self.cache.can_allocate(self.scheduler.outstanding_blocks() + need):
            raise CapacityError(f"decode worker has no room for {need} KV blocks")
        adm = self.cache.admit_remote(req.id, req.prompt_ids, req.session, samples=n)
        req.num_computed = req.prompt_len
        req.holds_cache = True
        req.cached_tokens = adm.cached_tokens
        self.requests[req.id] = req
        self.scheduler.reserve(req)
        return adm

    def _num_reserved(self) -> int:
        return sum(r.sampling.n for r in self.scheduler.reserved)

    def start_remote(self, request_id: str, first_token: int | list[int]) -> list[RequestOutput]:
        """Decode side: the prompt state has landed; decode from `first_token` on (one per
        sample when the request has n > 1: the request forks into its samples here)."""
        req = self.requests.get(request_id)
        if req is None or req.phase is not Phase.WAITING:
            raise TransferError(
                f"request {request_id} holds no reservation here (its lease expired or it was "
                f"aborted); the router retries or reports it"
            )
        firsts = [first_token] if isinstance(first_token, int) else list(first_token)
        if len(firsts) != req.sampling.n:
            raise InvalidRequestError(
                f"request {request_id} has n={req.sampling.n} samples but {len(firsts)} first "
                "tokens came; send one first token per sample")
        vocab = self.model.config.vocab_size
        for tok in firsts:
            if not 0 <= tok < vocab:  # it would fail the whole decode batch's forward
                raise InvalidRequestError(
                    f"first token id {tok} of request {request_id} is outside the "
                    f"vocabulary [0, {vocab}); send the token the prefill worker returned"
                )
        req.phase = Phase.DECODE
        self.cache.land(request_id)  # a 16-bit handoff widens into the live slot
        self.scheduler.start_reserved(req)
        samples = fork(self, req)
        for r in samples:
            r.first_token_time = time.monotonic()
        return self._append_tokens(list(zip(samples, firsts, strict=True)), [None] * len(firsts))

    def stream_layers(self, request_id: str, stream: LayerStream) -> None:
        """Any thread, even mid-step: stream the prefill request's last chunk layer by layer,
        picked up at the next layer boundary of that chunk (layers already computed go at
        once). If the chunk is over before that, `take_stream` gives the stream back."""
        with self._streams_lock:
            self._streams[request_id] = stream

    def take_stream(self, request_id: str) -> LayerStream | None:
        """The stream of `request_id` if no forward picked it up (then nothing was sent)."""
        with self._streams_lock:
            return self._streams.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """Prefill side: the handoff is done (or failed); free the request's cache."""
        self.abort(request_id)

    # ---- the step ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One step. A failure is confined to the requests it concerns: a request the pools
        can never hold, or whose blocks, snapshot or draw fail, ends alone with an ERROR
        output; a forward pass that raises ends the requests of that forward only (their
        state is half-updated), never the rest of the batch. An engine that speculates keeps
        the fast decode path (`BATON_DECODE_PATH=fast`) where its verify passes run on the
        same kernels as plain decode (`kernel_verify`: float32 pools, one process), else runs
        on the reference path: greedy output stays identical to speculation off either way."""
        if self.spec is None or self.spec.on_fast_path():
            return self._step()
        with reference_scope():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        failed = [self._fail(req, why) for req, why in self.scheduler.take_rejected()]
        if self.spec is None:  # their masks, computed during the forwards
            self.grammars.prefetch(plan.decodes)
        sampled = self._forked(self._prefill(plan.prefills, failed), failed)
        if sampled:  # the forward is over; what follows is the first tokens' draw
            now = time.monotonic()
            for req, _ in sampled:
                req.forward_done_time = now
        decided: list[RequestOutput] = []  # decoded by speculation (drafts verified)
        if plan.decodes and self.spec is not None:
            more, decided = self.spec.step(self, plan.decodes, failed)
            sampled.extend(more)
        elif plan.decodes:
            sampled.extend(self._decode_step(plan.decodes, failed))
        if not sampled:
            return failed + decided
        reqs = [r for r, _ in sampled]
        logits = _stacked([lg for _, lg in sampled])
        masked, broken = self.grammars.mask(logits, reqs)
        draws = self.sampler.sample(
            masked, [r.id for r in reqs], [r.sampling for r in reqs],
            [len(r.prompt_ids) + len(r.output_ids) for r in reqs],
            [(r.prompt_ids, r.output_ids) for r in reqs],
        )
        pairs, scored = [], []
        for i, (req, draw) in enumerate(zip(reqs, draws, strict=True)):
            if i in broken:
                failed.append(self._fail(req, broken[i]))
            elif draw.error is None:
                pairs.append((req, draw.token))
                scored.append(i)
            else:
                failed.append(self._fail(req, draw.error))
        return failed + decided + self._append_tokens(pairs, self._logprobs(logits, scored, pairs))

    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: list[int], pairs: list[tuple[Request, int]]):
        """Each drawn token's logprob (None for requests that asked for none), from the raw
        logits (`rows[i]`: pair i's row): one log-softmax for all that asked, with the largest
        top-N among them; nothing is computed or copied when none asked."""
        want = [i for i, (r, _) in enumerate(pairs) if r.sampling.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(pairs)
        if want:
            top = max(pairs[i][0].sampling.logprobs for i in want)
            lps = token_logprobs(logits[[rows[i] for i in want]], [pairs[i][1] for i in want],
                                 top)
            for i, lp in zip(want, lps, strict=True):
                k = pairs[i][0].sampling.logprobs
                out[i] = lp if k == top else TokenLogprob(lp.token_id, lp.logprob, lp.top[:k])
        return out

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """End `req` alone (one sample: its siblings go on): free what it holds and report an
        ERROR output naming why."""
        log.warning("request %s failed: %s", req.id, why)
        self._abort_one(req.id)
        return RequestOutput(req.key, (), True, FinishReason.ERROR, req.prompt_len,
                             req.cached_tokens, error=why, sample=req.sample,
                             open_samples=self.samples.close(req.key, req.sample))

    def _forked(self, sampled: list[tuple[Request, torch.Tensor]],
                failed: list[RequestOutput]) -> list[tuple[Request, torch.Tensor]]:
        """Each prompt that completed with n > 1 samples, forked: its n samples draw their
        first tokens from the same logits."""
        out = []
        for req, logits in sampled:
            if req.sampling.n == 1:
                out.append((req, logits))
                continue
            try:
                out.extend((r, logits) for r in fork(self, req))
            except Exception as e:  # noqa: BLE001 - one request's failure must not end its batch
                failed.append(self._fail(req, f"{type(e).__name__}: {e}"))
        return out

    def _guarded(self, req: Request, failed: list[RequestOutput], fn, *args) -> bool:
        """Run a per-request operation; on error fail that request alone and return False."""
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001 - one request's failure must not end its batch
            failed.append(self._fail(req, f"{type(e).__name__}: {e}"))
            return False

    def _prefill(self, chunks: list[tuple[Request, int]],
                 failed: list[RequestOutput]) -> list[tuple[Request, torch.Tensor]]:
        """Run the step's prompt chunks, one forward per group of equally long chunks; return
        the last-token logits of the requests whose prompt is now complete, in plan order."""
        groups: dict[int, list[tuple[Request, int]]] = {}
        now = time.monotonic()
        for req, end in chunks:
            if req.prefill_start_time is None:
                req.prefill_start_time = now
            if self._guarded(req, failed, self.cache.ensure_blocks, req.id, end):
                groups.setdefault(end - req.num_computed, []).append((req, end))
        logits: dict[str, torch.Tensor] = {}
        for group in groups.values():
            try:
                out = self._prefill_group(group)
            except Exception as e:  # noqa: BLE001 - fails this forward's requests only
                log.exception("prefill forward of %d requests failed", len(group))
                failed.extend(self._fail(r, f"prefill forward failed: {e}") for r, _ in group)
                continue
            logits.update(zip([r.id for r, _ in group], out, strict=True))
        done = []
        for req, end in chunks:
            if req.id in logits and self._guarded(req, failed, self._commit_chunk, req, end) \
                    and req.phase is Phase.DECODE:
                done.append((req, logits[req.id]))
        return done

    def _prefill_group(self, group: list[tuple[Request, int]]) -> torch.Tensor:
        """The group's last-position logits [n, vocab]; a request that asked for prompt
        logprobs has its chunk's positions scored (the group then computes every position)."""
        ids = [req.prompt_ids[req.num_computed : end] for req, end in group]
        scored = [i for i, (req, _) in enumerate(group) if req.sampling.prompt_logprobs is not None]
        # the MTP head reads the chunk's hidden states (a pipeline runs it in the forward)
        nexts = self.spec.prefill_inputs(group, self.cache) if self.spec is not None else None
        hidden = [] if nexts is not None else None
        extra = {} if hidden is None else {"hidden_out": hidden}
        if nexts is not None and self.spec.drafter.in_forward:
            extra["mtp_next"] = nexts
        on_layer = self._begin_streams(group)
        out = self.model.prefill_batch(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            [req.num_computed for req, _ in group],
            [self.cache.block_table(req.id) for req, _ in group],
            [self.cache.slot(req.id) for req, _ in group],
            self.pools,
            all_logits=bool(scored),
            on_layer=on_layer,
            **extra,
        )
        if hidden:
            self.spec.after_prefill(group, nexts, hidden[0], self.cache)
            for layer in self.spec.draft_layers if on_layer is not None else ():
                on_layer(layer)  # the head's KV ships with the target's
        if not scored:
            return out
        for i in scored:
            req, end = group[i]
            req.prompt_logprobs.extend(prompt_logprobs(
                out[i], req.prompt_ids, req.num_computed, end, req.sampling.prompt_logprobs))
        return out[:, -1]

    def _begin_streams(self, group: list[tuple[Request, int]]):
        """The per-layer callback of a forward that holds the last chunk of prefill-only
        requests: it hands each layer to the request's stream, once the stream exists."""
        last = {req.id: req for req, end in group if req.prefill_only and end == req.prompt_len}
        if not last:
            return None
        active: dict[str, LayerStream] = {}
        cuda = str(self.device).startswith("cuda")
        # 16-bit handoffs: each rounded layer is narrowed into a snapshot-pool slot, which a
        # decode worker receiving 16-bit state is sent from (docs/state-precision.md)
        staged = {rid: self.cache.stage(rid) for rid, req in last.items()
                  if self.stages_handoffs and req.prompt_len in req.round_points}

        def on_layer(layer: int) -> None:
            if self.rounding is not None:  # the prompt end rounds before its bytes leave
                for rid, req in last.items():
                    if req.prompt_len in req.round_points:  # as _commit_chunk will
                        self.rounding.round(self.cache.slot(rid), req.prompt_ids, [layer])
                for rid, stage in staged.items():
                    if stage is not None:
                        self._narrow_layer(self.cache.slot(rid), stage, layer)
            if cuda:  # the layer's kernels must be done before its bytes leave
                torch.cuda.current_stream().synchronize()
            for stream in active.values():
                stream.layers_done([layer])
            for rid in [r for r in last if r not in active]:
                stream = self.take_stream(rid)
                if stream is not None:
                    slot = self.cache.slot(rid) if self.pools.has_state else None
                    table = self.cache.block_table(rid) if self.pools.has_kv else []
                    stream.begin(list(table), slot)
                    stream.layers_done(list(range(layer + 1)))
                    active[rid] = stream

        return on_layer

    @property
    def stages_handoffs(self) -> bool:
        """Whether handed-off state moves in 16 bits through a snapshot-pool slot (`stage`):
        the state is rounded, the pools have a snapshot pool, and they are this process's own
        (pipeline / tensor-parallel pools move float32 live slots)."""
        p = self.pools
        return (self.rounding is not None and p.has_state and bool(p.spec.snapshot_slots)
                and getattr(p, "ops", None) is None)

    @property
    def lands_handoffs(self) -> bool:
        """Decode side: whether handed-off state lands in 16 bits in a snapshot-pool slot
        (`cache.stage`), widened into the live slot at `start_remote` (`cache.land`). Also
        under PP / TP: each stage / rank receives its own layers / shard into its own
        snapshot pool, and the widening is a mirrored slot copy they apply before their
        next forward."""
        p = self.pools
        return self.rounding is not None and p.has_state and bool(p.spec.snapshot_slots)

    def _narrow_layer(self, live: int, stage: int, layer: int) -> None:
        """Copy global state `layer` of slot `live` into snapshot slot `stage` (narrowing a
        rounded value: lossless)."""
        p, i = self.pools, self.pools.spec.state_index.get(layer)
        if i is None:
            return
        n = p.spec.num_slots
        for name, pool in p.state.items():
            p.snapshots[name][i, stage - n].copy_(pool[i, live])

    def stage_whole(self, request_id: str) -> int | None:
        """Prefill side, after the prompt's last chunk: its rounded prompt-end state narrowed
        into a staging snapshot slot (mirrored to pipeline stages); None when the prompt end
        was not rounded or no staging slot can be had."""
        req = self.requests.get(request_id)
        if req is None or self.rounding is None or req.rounded_at != req.prompt_len:
            return None
        stage = self.cache.stage(request_id)
        if stage is not None:
            self.pools.copy_slot(self.cache.slot(request_id), stage)
        return stage

    def _commit_chunk(self, req: Request, end: int) -> None:
        """Book a computed chunk; a chunk that completes the prompt moves it to DECODE."""
        self.prefilled_tokens += end - req.num_computed
        req.num_computed = end
        if self.rounding is not None and end in req.round_points:
            self.rounding.round(self.cache.slot(req.id), req.prompt_ids[:end])
            req.rounded_at = end
        try:
            self.cache.commit(req.id, req.prompt_ids[:end])
        except CapacityError as e:  # a snapshot is an optimisation: skip it, never fail the request
            log.warning("snapshot for %s at %d skipped: %s", req.id, end, e)
        if end >= req.prompt_len:
            req.phase = Phase.DECODE

    def _decode_step(self, reqs: list[Request],
                     failed: list[RequestOutput]) -> list[tuple[Request, torch.Tensor]]:
        reqs = [r for r in reqs
                if self._guarded(r, failed, self.cache.ensure_blocks, r.id, r.num_computed + 1)]
        if not reqs:
            return []
        try:
            logits = self._decode(reqs)
        except Exception as e:  # noqa: BLE001 - fails this forward's requests only
            log.exception("decode forward of %d requests failed", len(reqs))
            failed.extend(self._fail(r, f"decode forward failed: {e}") for r in reqs)
            return []
        return list(zip(reqs, logits, strict=True))

    def _decode(self, reqs: list[Request], hidden_out: list | None = None) -> torch.Tensor:
        """One plain decode forward of `reqs`; `hidden_out` (a list, for models with
        `decode_hidden`) gets their final-normed hiddens appended (speculation's head reads
        them)."""
        for r in reqs:
            self.cache.ensure_blocks(r.id, r.num_computed + 1)
        more = {} if hidden_out is None else {"hidden_out": hidden_out}
        if self.batch is not None:  # the metadata tensors of the last step, moved on in place
            ids, pos, tables, slots = self.batch.update(reqs)
            b = len(reqs)
            if self.batch.buckets:  # fixed shapes, read without a host sync; pad rows cut off
                if self.cache.pad_slot is not None:
                    self.pools.zero_slot(self.cache.pad_slot)
                more["static"] = True
                if hidden_out is not None:
                    more["hidden_out"] = padded = []
            logits = self.model.decode(ids, pos, tables, slots, self.pools, **more)
            if hidden_out is not None and self.batch.buckets:
                hidden_out.extend(h[:b] for h in padded)
            for r in reqs:
                r.num_computed += 1
            return logits[:b]
        ids = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long, device=self.device)
        pos = torch.tensor([r.num_computed for r in reqs], dtype=torch.long, device=self.device)
        slots = torch.tensor([self.cache.slot(r.id) for r in reqs], dtype=torch.long, device=self.device)
        tables = [self.cache.block_table(r.id) for r in reqs]
        logits = self.model.decode(ids, pos, tables, slots, self.pools, **more)
        for r in reqs:
            r.num_computed += 1
        return logits

    def _append_tokens(self, pairs: list[tuple[Request, int]],
                       logprobs: list[TokenLogprob | None]) -> list[RequestOutput]:
        now = time.monotonic()
        done = []
        for req, tok in pairs:
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._finish_reason(req, tok)
            if reason or req.prefill_only:
                req.finish_reason = reason
                req.finish_time = now
                done.append(req)
        if done:  # before the outputs: a last output says which decode-end snapshot it left
            self._finish(done)
        return [self._output(req, (tok,), finished=req.finish_reason is not None
                             or req.prefill_only, logprob=lp)
                for (req, tok), lp in zip(pairs, logprobs, strict=True)]

    def _finish_reason(self, req: Request, tok: int) -> FinishReason | None:
        s = req.sampling
        if (not s.ignore_eos and tok in self.eos_ids) or tok in s.stop_token_ids:
            return FinishReason.STOP
        if len(req.output_ids) >= s.max_tokens or req.prompt_len + len(req.output_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.scheduler.remove(r)
            r.phase = Phase.FINISHED
        keep = [r for r in reqs if not r.prefill_only]
        broken = False
        if self.decode_end_snapshot and keep:
            try:  # feed the last token so the snapshot covers prompt + answer
                if self.spec is not None:  # the same decode, keeping the last hidden state
                    self.spec.feed_last(self, keep)
                else:
                    self._decode(keep)
            except Exception:  # noqa: BLE001 - the answers are complete; only the snapshot is lost
                log.exception("decode-end snapshot of %d requests failed; not kept", len(keep))
                broken = True
        for r in reqs:
            self.grammars.forget(r.id)
            if self.spec is not None:
                self.spec.forget(r.id)
            if r.prefill_only and r.family is not None:  # a drawn first token, no cache
                self.requests.pop(r.id, None)
                self.sampler.forget(r.id)
        for r in keep:
            self.requests.pop(r.id, None)
            self.sampler.forget(r.id)
            try:
                if broken:  # a half-run forward leaves a state no snapshot may keep
                    self.cache.abort(r.id)
                else:
                    if (self.rounding is not None and self.rounding.at_decode_end
                            and r.rounded_at != r.num_computed):  # (a prefill-only request's
                        # decode end is its prompt end, rounded already: rounding is idempotent)
                        self.rounding.round(self.cache.slot(r.id), r.all_ids[: r.num_computed])
                    if self.cache.finish(r.id, r.all_ids[: r.num_computed]):
                        r.end_snapshot_tokens = r.num_computed
            except Exception:  # noqa: BLE001 - the request finished; its neighbours go on
                log.exception("releasing finished request %s failed", r.id)

    def _output(self, req: Request, toks: tuple[int, ...], finished: bool,
                logprob: TokenLogprob | None = None) -> RequestOutput:
        ttft = latency = None
        if req.first_token_time is not None:
            ttft = (req.first_token_time - req.arrival) * 1000
        if finished and req.finish_time is not None:
            latency = (req.finish_time - req.arrival) * 1000
        return RequestOutput(
            request_id=req.key,
            new_token_ids=toks,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_tokens,
            ttft_ms=ttft,
            latency_ms=latency,
            snapshot_tokens=req.end_snapshot_tokens if finished else 0,
            logprobs=(logprob,) if logprob is not None else (),
            # the first token drawn here follows the prompt's last chunk
            prompt_logprobs=tuple(req.prompt_logprobs) if len(req.output_ids) == 1 else (),
            draft_tokens=req.draft_tokens,
            accepted_tokens=req.accepted_tokens,
            sample=req.sample,
            open_samples=self.samples.close(req.key, req.sample) if finished else 0,
        )


def pads(cache) -> bool:
    """Whether `cache` keeps a pad block and slot for bucketed decode steps."""
    return (getattr(cache, "pad_slot", None) is not None
            or getattr(cache, "pad_block", None) is not None)


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """The rows as one [n, vocab] tensor: a view when they are consecutive rows of one tensor
    (a decode step's logits, in order: no copy, ~0.3 ms of a batch-32 step over a 16k
    vocabulary), else a stack."""
    first = rows[0]
    width, storage = first.numel(), first.untyped_storage().data_ptr()
    step = width * first.element_size()
    if first.dim() == 1 and all(
            r.dim() == 1 and r.is_contiguous() and r.dtype == first.dtype and r.numel() == width
            and r.device == first.device and r.untyped_storage().data_ptr() == storage
            and r.data_ptr() == first.data_ptr() + i * step for i, r in enumerate(rows)):
        return first.as_strided((len(rows), width), (width, 1))
    return torch.stack(rows)
