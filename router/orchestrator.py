"""One request's path through the cluster: route -> Reserve -> Prefill -> Decode stream.

key = the router's own id for the request (the client's request_id is only echoed back)
check_limits                          what no worker could take -> InvalidRequestError
wait_turn                             behind requests already queued, in arrival order
for each attempt (until max_retries failed pairs):
  policy.choose -> (P, D)             every candidate full -> wait in the queue, try all again
  conditional.decide                  a decode worker holds the prompt up to a short increment:
    D.Serve -> first token            it runs the request alone (router/conditional.py);
                                      LocalPrefillDeclined (its own match says no) -> P+D
  P.Prefill   stream opened: P computes from now on, while
  D.Reserve   -> Reservation          WorkerFailed -> Abort(P, D), exclude the failed one, retry
                                      WorkerBusy (full) -> skip that worker, try another
  P.Prefill   <- Reservation -> first token (after the handoff)
                                      InvalidRequestError -> Abort(P, D), raise as is
  yield first token
  D.Decode    -> chunks until finish_reason
                                      D dies mid-stream (WorkerFailed) -> the request moves:
                                      a new pair prefills prompt + tokens sent, decoding goes
                                      on in the same client stream (router/failover.py)
while P works for D, D's loss (worker_client's liveness probe) cancels P's call at once
any exit before the finish (error, client cancel, generator closed) -> Abort(P, D)
the client ends the answer itself (cancel.stop(): an HTTP stop string) -> Abort(P, D) too, but
                                      the stream still ends with the summary (finish STOP)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Protocol

from baton.config.router import RouterConfig
from baton.contract import (
    DecodeChunk,
    FinishReason,
    GenerateChunk,
    GenerateInput,
    GenerateSummary,
    PrefillInput,
    PrefillResult,
    Reservation,
    ReserveInput,
    Role,
    WorkerView,
)
from baton.errors import (
    InvalidRequestError,
    LocalPrefillDeclined,
    NoWorkersError,
    RequestCancelled,
    WorkerBusy,
    WorkerFailed,
)
from baton.model.detokenizer import IncrementalDetokenizer
from baton.worker import phases
from router.admission import AdmissionQueue, Ticket, check_limits
from router.cancellation import Cancellation
from router.conditional import (
    DISAGGREGATED,
    LOCAL,
    LocalAttempt,
    PathCounts,
    decide,
    spec_counts,
)
from router.failover import PeerWatch, resumed
from router.locality import SnapshotLocator
from router.policies import RouteChoice, RouteRequest, RoutingPolicy
from router.registry import Registry
from router.samples import fan_out, heads
from router.shipping import DecodeEndShipper

log = logging.getLogger(__name__)


class WorkerClient(Protocol):
    """Calls on one worker. Raise WorkerFailed, InvalidRequestError or RequestCancelled."""

    def reserve(self, req: ReserveInput, cancel: Cancellation) -> Reservation: ...

    def start_prefill(self, req: PrefillInput, cancel: Cancellation) -> PrefillCall:
        """Starts computing `req` (destination None: it follows through `finish`)."""

    def decode(
        self, request_id: str, first_token_id: int, cancel: Cancellation
    ) -> Iterator[DecodeChunk]: ...

    def abort(self, request_id: str) -> bool:
        """Best effort: never raises; False when the worker held nothing or was unreachable."""


class PrefillCall(Protocol):
    def finish(self, destination: Reservation | None) -> PrefillResult:
        """Hands over the destination and waits for the first token (the handoff is done)."""

    def cancel(self) -> None:
        """No destination will come; the worker drops the request."""


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Orchestrator:
    def __init__(
        self,
        config: RouterConfig,
        registry: Registry,
        policy: RoutingPolicy,
        clients: Callable[[WorkerView], WorkerClient],
        tokenizer: Tokenizer | None = None,
    ):
        self.config = config
        self.registry = registry
        self.policy = policy
        self.clients = clients
        self.tokenizer = tokenizer
        self.queue = AdmissionQueue(config)
        """Requests waiting, in arrival order, while every decode worker is full."""
        self.locator = SnapshotLocator(config, policy)
        if self.locator.listens:
            registry.add_listener(self.locator)
        self.paths = PathCounts()
        """Requests by path (decode worker alone or prefill + decode) and reason."""
        self.shipper = DecodeEndShipper(self)
        """Decode-end snapshots shipped back to prefill workers (router/shipping.py)."""
        self.peers = PeerWatch()
        """Attempts whose prefill works for a decode worker: cancelled when it is lost."""
        self._picking = threading.Lock()
        """Held while a request's pair is chosen and counted (`_route`)."""

    def generate(self, inp: GenerateInput, cancel: Cancellation) -> Iterator[GenerateChunk]:
        """Validates, then streams the request's chunks; the last one carries the summary.

        The client's request id is only a label echoed in the chunks: on the workers the
        request has its own key, so two requests that share an id are two requests."""
        key = uuid.uuid4().hex
        rid = inp.request_id or key
        prompt = self._prompt_ids(inp)
        inp.sampling.validate()
        check_limits(prompt, inp.sampling, self.registry.workers())
        start = time.perf_counter()
        ticket = self.queue.arrive(rid)
        try:
            run, first, retries = self._start(key, rid, prompt, inp, cancel, ticket)
        finally:
            self.queue.leave(ticket)
        if isinstance(run, _Attempt):
            run.arrived = start
        yield from self._stream(key, rid, prompt, inp, cancel, ticket.seq, run, first, start,
                                retries)

    def _stream(self, key, rid, prompt, inp: GenerateInput, cancel: Cancellation, seq: int,
                run: _Attempt, first: PrefillResult, start: float, retries: int):
        """The attempt's chunks; if its decode worker dies mid-stream, the request moves to a
        new pair that prefills prompt + the tokens sent (at most max_retries moves) and the
        stream goes on: same detokenizer, one summary counting every token once."""
        sent: list[int] = []
        cached, ttft_ms = first.cached_tokens, None
        for moves in itertools.count():
            try:
                for chunk in run.stream(first, start, retries=retries):
                    sent.extend(chunk.token_ids)
                    if ttft_ms is None:
                        ttft_ms = (time.perf_counter() - start) * 1000
                    if moves and chunk.summary is not None:  # as if it had never moved
                        chunk = replace(chunk, summary=replace(
                            chunk.summary, prompt_tokens=len(prompt), cached_tokens=cached,
                            ttft_ms=ttft_ms))
                    yield chunk
                return
            except WorkerFailed as e:
                if e.worker_id != run.d.worker_id or not sent or \
                        moves >= self.config.max_retries or inp.sampling.n > 1:
                    raise  # (a request of several samples is not moved)
                log.warning("request %s: decode worker %s died after %d tokens; moving it to a "
                            "new pair (%s)", rid, e.worker_id, len(sent), e)
                detok, ticket = run._detok, Ticket(seq, rid)  # its place: its arrival
                try:
                    moved_prompt, moved_inp = resumed(inp, prompt, sent)
                    run, first, more = self._start(
                        f"{key}~move{moves + 1}", rid, moved_prompt, moved_inp, cancel, ticket,
                        excluded={e.worker_id})
                except (WorkerFailed, NoWorkersError, ValueError) as moving:
                    raise WorkerFailed(e.worker_id, "Decode", f"{str(e).split(': ', 1)[-1]}; "
                                       f"moving the request failed: {moving}") from moving
                finally:
                    self.queue.leave(ticket)
                run._detok = detok
                retries += more + 1

    def _start(self, key, rid, prompt, inp: GenerateInput, cancel: Cancellation, ticket,
               excluded: set[str] | None = None):
        """Pairs until one gives the first token: a failed worker is excluded (at most
        max_retries times), a full one skipped; when all are full the request waits in the
        queue (arrival order) and tries them all again."""
        excluded = set(excluded or ())
        full: set[str] = set()
        failures: list[str] = []
        declined = False
        self.queue.wait_turn(ticket, cancel)
        for n in itertools.count():
            try:
                choice = self._route(RouteRequest(key, prompt, inp.session_id), excluded | full,
                                     failures)
            except NoWorkersError:
                if not full:
                    raise
                self.queue.wait_for_capacity(ticket, cancel)
                full.clear()
                continue
            # each attempt has its own id on the workers: a late event of a failed attempt
            # (lease expiry, stray transfer) can then never touch the retry's reservation
            wid = key if n == 0 else f"{key}~retry{n}"
            try:  # the pair stays counted (`_route`) until the attempt counts its own workers
                local, reason = (None, "worker_declined") if declined else \
                    self._local_decode(prompt, choice, excluded | full, inp.sampling)
                if local is not None:
                    run = LocalAttempt(self, rid, wid, prompt, inp, local, cancel)
                else:
                    self.shipper.wait_for(choice.prefill, prompt)  # a turn on its way there
                    run = _Attempt(self, rid, wid, prompt, inp, choice, cancel)
                run.count()
            finally:
                self.registry.end(choice.prefill.worker_id)
                self.registry.end(choice.decode.worker_id)
            try:
                first = run.start()
                self.paths.add(LOCAL if local is not None else DISAGGREGATED, reason)
                log.info("request %s: %s (%s)", rid, "decode worker alone" if local is not None
                          else "prefill + decode", reason)
                return run, first, len(failures)
            except LocalPrefillDeclined as e:
                log.info("request %s: %s; through a prefill worker instead", rid, e)
                declined = True
            except WorkerBusy as e:
                full.add(e.worker_id)
            except WorkerFailed as e:
                log.warning("request %s (%s) attempt %d: %s", rid, wid, n + 1, e)
                excluded.add(e.worker_id)
                failures.append(str(e))
                if len(failures) > self.config.max_retries:
                    raise NoWorkersError(
                        f"request {rid} failed on {len(failures)} worker pairs (max_retries="
                        f"{self.config.max_retries}): " + "; ".join(failures)
                    ) from None
        raise AssertionError("unreachable")

    def tracked(self) -> dict[str, int]:
        """Per-request bookkeeping sizes (the debug gauge `baton_router_tracked`): each is 0
        once no request runs and no decode-end shipment is on its way."""
        return {"registry_inflight": self.registry.inflight(), "peer_watches": self.peers.total(),
                "queued": self.queue.waiting, "shipments": self.shipper.in_flight}

    def _prompt_ids(self, inp: GenerateInput) -> tuple[int, ...]:
        if inp.prompt_ids and inp.prompt_text:
            raise InvalidRequestError("send either prompt or prompt_ids, not both")
        if inp.prompt_text:
            size = len(inp.prompt_text.encode("utf-8", "surrogatepass"))
            if size > self.config.max_prompt_bytes:  # before paying for the tokenizer
                raise InvalidRequestError(
                    f"prompt text is {size} bytes, over the router's limit of "
                    f"{self.config.max_prompt_bytes} (router.max_prompt_bytes); shorten it"
                )
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this router has no tokenizer: send prompt_ids instead of prompt text"
                )
            ids = tuple(self.tokenizer.encode(inp.prompt_text))
        else:
            ids = tuple(inp.prompt_ids or ())
        if not ids:
            raise InvalidRequestError("prompt is empty: send a non-empty prompt or prompt_ids")
        bad = [t for t in ids if t < 0]
        if bad:
            raise InvalidRequestError(f"prompt_ids must be >= 0, got {bad[:5]}")
        return ids

    def turn_ended(self, decode: WorkerView, tokens: tuple[int, ...], snapshot_tokens: int,
                   prefill: WorkerView | None = None):
        """A request finished on `decode` (its prompt computed by `prefill`, None: by the
        decode worker), leaving a decode-end snapshot of `tokens[:snapshot_tokens]` (0: none):
        index it now and ship it back if no prefill worker has it."""
        self.locator.hint(decode, tokens, snapshot_tokens)
        self.shipper.after_turn(decode, tokens, snapshot_tokens, prefill)

    def _local_decode(self, prompt, choice: RouteChoice, skip: set[str], sampling):
        """(decode worker to serve the request alone or None, the reason): conditional.decide."""
        if self.config.local_prefill_max_tokens == 0:
            return None, "disabled"
        if sampling.prompt_logprobs is not None:  # the whole prompt is computed anyway
            return None, "prompt_logprobs"
        # the loads as they were before this request's own count on its pair (`_route`)
        decode = [replace(w, inflight=max(w.inflight - 1, 0))
                  if w.worker_id == choice.decode.worker_id else w
                  for w in self.registry.workers(Role.DECODE) if w.worker_id not in skip]
        matched = self.locator.matched_tokens(prompt, decode)
        return decide(len(prompt), matched, decode, choice.decode, self.config)

    def _route(self, req: RouteRequest, excluded: set[str], failures: list[str]) -> RouteChoice:
        """The policy's pair, counted on both workers (`Registry.begin`; the caller ends the
        counts) before the next request is routed: a burst of requests that all saw the same
        loads went to the same least-loaded worker."""
        with self._picking:
            pools = {}
            for role in (Role.PREFILL, Role.DECODE):
                live = self.registry.workers(role)
                pools[role] = [w for w in live if w.worker_id not in excluded]
                if not pools[role]:
                    why = f" ({len(live)} live, all failed: {'; '.join(failures)})" if live \
                        else ""
                    raise NoWorkersError(f"no {role.value} worker available{why}")
            choice = self.policy.choose(req, pools[Role.PREFILL], pools[Role.DECODE])
            self.registry.begin(choice.prefill.worker_id)
            self.registry.begin(choice.decode.worker_id)
            return choice


def _alive(client) -> bool:
    """Whether the worker behind `client` still runs (clients without a probe: assume so)."""
    probe = getattr(client, "alive", None)
    return True if probe is None else probe()


class _Attempt:
    """One worker pair's try at a request; aborts both workers unless it finished."""

    def __init__(self, orch, rid, wid, prompt, inp: GenerateInput, choice: RouteChoice, cancel):
        self.orch, self.rid, self.prompt, self.inp = orch, rid, prompt, inp
        self.wid = wid
        """The request's key on the workers (the router's own; `rid` is the client's label)."""
        self.p, self.d = choice
        self.cancel = cancel
        self.pc, self.dc = orch.clients(self.p), orch.clients(self.d)
        self._lock = threading.Lock()
        self._aborted = False
        tok = orch.tokenizer
        self._detok = IncrementalDetokenizer(tok) if tok is not None else None
        self.arrived: float | None = None
        """perf_counter() of Generate's arrival (`r_route`, `r_ttft`)."""
        self._at: dict[str, float] = {}
        """perf_counter() of this attempt's instants, for its phases (baton/worker/phases.py)."""

    def count(self) -> None:
        """Counts the attempt on its workers (until `_finish`); `start` follows at once."""
        self.orch.registry.begin(self.p.worker_id)
        self.orch.registry.begin(self.d.worker_id)

    def start(self) -> PrefillResult:
        inp, cancel = self.inp, self.cancel
        try:
            # A cancel while Reserve/Prefill block aborts both workers, which ends the calls.
            with cancel.hook(self._abort_in_background):
                # Prefill computes while Reserve runs; the transfer waits only for the destination
                self._at["prefill"] = time.perf_counter()
                self._at["prefill_mono"] = time.monotonic()
                call = self.pc.start_prefill(
                    PrefillInput(self.wid, self.prompt, inp.sampling, inp.session_id), cancel
                )
                lost = threading.Event()

                def on_lost():  # P works for a dead D: end P's call now, not at lease expiry
                    lost.set()
                    call.cancel()

                with self.orch.peers.watching(self.d.worker_id, on_lost):
                    try:
                        self._at["reserve"] = time.perf_counter()
                        res = self.dc.reserve(
                            ReserveInput(self.wid, self.prompt, inp.sampling, inp.session_id),
                            cancel,
                        )
                        self._at["reserved"] = time.perf_counter()
                        self._check_cancelled("Reserve")
                    except BaseException:
                        call.cancel()
                        raise
                    try:
                        result = call.finish(res)
                        self._at["prefilled_mono"] = time.monotonic()
                        self._at["prefilled"] = time.perf_counter()
                    except (WorkerFailed, RequestCancelled) as e:
                        # a prefill that failed because its destination died is D's failure
                        if not cancel.cancelled and (lost.is_set() or (
                                isinstance(e, WorkerFailed) and e.worker_id == self.p.worker_id
                                and not _alive(self.dc))):
                            raise WorkerFailed(self.d.worker_id, "the handoff", (
                                "it died while the prefill worked for it; the prefill was "
                                "cancelled")) from e
                        raise
                self._check_cancelled("Prefill")
            return result
        except WorkerBusy as e:  # a worker that refused as full holds nothing of this attempt
            self._finish(abort=e.worker_id != self.d.worker_id or self.cancel.cancelled)
            raise
        except BaseException:
            self._finish(abort=True)
            raise

    def stream(self, first: PrefillResult, start: float, retries: int) -> Iterator[GenerateChunk]:
        if first.samples:
            yield from self._samples(first, start, retries)
            return
        finished = False
        try:
            self._at["first_chunk"] = now = time.perf_counter()
            self._at["first_chunk_mono"] = time.monotonic()
            ttft_ms = (now - start) * 1000
            first_ids = (first.first_token_id,)
            lps = (first.logprobs,) if first.logprobs is not None else ()
            if first.finished:
                finished = True
                reason = first.finish_reason or FinishReason.STOP
                yield self._chunk(first_ids, first, reason, start, ttft_ms, retries, lps,
                                  first.prompt_logprobs)
                return
            yield self._chunk(first_ids, first, None, start, ttft_ms, retries, lps,
                              first.prompt_logprobs)
            output = list(first_ids)
            try:
                if not self.cancel.stopped:  # else the answer ended with its first token
                    for chunk in self.dc.decode(self.wid, first.first_token_id, self.cancel):
                        self._at.setdefault("decode_first", time.perf_counter())
                        finished = chunk.finish_reason is not None
                        output.extend(chunk.token_ids)
                        if finished:  # the decode-end snapshot, known before the next turn
                            self.orch.turn_ended(self.d, self.prompt + tuple(output),
                                                 chunk.snapshot_tokens, self.p)
                            self._spec = (chunk.draft_tokens, chunk.accepted_tokens)
                        yield self._chunk(chunk.token_ids, first, chunk.finish_reason, start,
                                          ttft_ms, retries, chunk.logprobs)
                        if finished:
                            return
            except (RequestCancelled, WorkerFailed):
                if not self.cancel.stopped:
                    raise
            if not self.cancel.stopped:
                raise WorkerFailed(self.d.worker_id, "Decode",
                                   "stream ended without a finish_reason")
            # the client ended the answer (a stop string): Decode was cancelled and both
            # workers are aborted below, but the request still ends with its summary
            yield GenerateChunk(self.rid, (), "", self._summary(
                FinishReason.STOP, first, start, ttft_ms, retries))
        finally:
            if first.finished:
                self.dc.abort(self.wid)  # releases the reservation Decode would have used
            self._finish(abort=not finished)

    def _samples(self, first: PrefillResult, start: float,
                 retries: int) -> Iterator[GenerateChunk]:
        """n > 1: every sample's first token, then the decode worker's stream of them all
        (router/samples.py); the reservation is freed if every first token ended its sample."""
        self._at["first_chunk"] = now = time.perf_counter()
        self._at["first_chunk_mono"] = time.monotonic()
        ttft_ms = (now - start) * 1000
        decodes = not all(f.finished for f in first.firsts)

        def chunks():
            yield from heads(first)
            if decodes:
                yield from self.dc.decode(self.wid, first.first_token_id, self.cancel,
                                          tuple(f.first_token_id for f in first.samples))

        def ended(output: tuple[int, ...], snapshot_tokens: int) -> None:
            self.orch.turn_ended(self.d, self.prompt + output, snapshot_tokens, self.p)

        finished = False
        try:
            yield from fan_out(self.rid, len(first.firsts), self.orch.tokenizer, self.cancel,
                               chunks(), lambda r: self._summary(r, first, start, ttft_ms,
                                                                 retries),
                               lambda i: self.dc.abort(self.wid, i), self.d.worker_id,
                               first.prompt_logprobs, ended)
            finished = True
        finally:
            if not decodes:
                self.dc.abort(self.wid)  # releases the reservation Decode would have used
            self._finish(abort=not finished)

    def _chunk(self, new, first, reason: FinishReason | None, start, ttft_ms, retries,
               logprobs=(), prompt_logprobs=()):
        text = ""
        if self._detok is not None:
            # only the new tokens are decoded (with a little context); a character cut
            # between two chunks is held back until complete, the rest flushed at the end
            text = self._detok.push(new)
            if reason is not None:
                text += self._detok.flush()
        summary = None
        if reason is not None:
            summary = self._summary(reason, first, start, ttft_ms, retries)
        return GenerateChunk(self.rid, tuple(new), text, summary, tuple(logprobs),
                             tuple(prompt_logprobs))

    def _summary(self, reason: FinishReason, first: PrefillResult, start, ttft_ms,
                 retries) -> GenerateSummary:
        return GenerateSummary(
            finish_reason=reason,
            prompt_tokens=len(self.prompt),
            cached_tokens=first.cached_tokens,
            prefill_worker=self.p.worker_id,
            decode_worker=self.d.worker_id,
            ttft_ms=ttft_ms,
            latency_ms=(time.perf_counter() - start) * 1000,
            retries=retries,
            **spec_counts(getattr(self, "_spec", None)),
            phases_ms=self.phases(first),
        )

    def phases(self, first: PrefillResult) -> dict[str, float]:
        """The request's phases: the prefill worker's and the router's own
        (baton/worker/phases.py); empty unless this attempt gave the first token."""
        at = self._at
        if "first_chunk" not in at or "prefilled" not in at:
            return {}

        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else (b - a) * 1000

        call = ms(at.get("prefill"), at["prefilled"])
        worker = first.phases_ms.get("p_total")
        got = dict(first.phases_ms)
        opened, replied = phases.split_rpc(got.pop(phases.AT_ARRIVAL, None),
                                           got.pop(phases.AT_REPLY, None),
                                           at.get("prefill_mono"), at.get("prefilled_mono"))
        return {**got, **phases.clean({
            "r_route": ms(self.arrived, at.get("prefill")),
            "r_reserve": ms(at.get("reserve"), at.get("reserved")),
            "r_prefill": call,
            "r_rpc": None if call is None or worker is None else call - worker,
            "r_open": opened,
            "r_reply": replied,
            "r_first_chunk": ms(at["prefilled"], at["first_chunk"]),
            "r_ttft": ms(self.arrived, at["first_chunk"]),
            "r_decode_first": ms(at["first_chunk"], at.get("decode_first")),
        }), phases.AT_FIRST_CHUNK: at["first_chunk_mono"] * 1000}

    def _check_cancelled(self, what: str) -> None:
        if self.cancel.cancelled:
            raise RequestCancelled(f"request {self.rid} cancelled during {what}")

    def _finish(self, abort: bool) -> None:
        if abort:
            self._abort_once()
        self.orch.registry.end(self.p.worker_id)
        self.orch.registry.end(self.d.worker_id)
        self.orch.queue.capacity_freed()

    def _abort_once(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        self._abort()

    def _abort(self) -> None:
        for client in (self.pc, self.dc):
            client.abort(self.wid)

    def _abort_in_background(self) -> None:
        """Cancelled while Reserve / Prefill run: the Abort ends the prefill now. It does not
        count as the attempt's abort: a Reserve still on its way makes its reservation after
        this Abort found nothing, so `_finish` aborts again once the calls returned (else the
        blocks stayed held until the lease ran out)."""
        threading.Thread(target=self._abort, name=f"abort-{self.rid}", daemon=True).start()

