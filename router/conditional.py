"""Conditional disaggregation: run a request on a decode worker alone when it holds the prompt.

    decide(prompt_len, matched, decode candidates, the policy's decode pick, config)
      local_prefill_max_tokens == 0              -> P+D  "disabled"
      no decode candidate reports a snapshot     -> P+D  "no_decode_snapshot"
      holders all busier than the slack allows   -> P+D  "decode_busy"
      best holder (deepest; then the policy's pick, then load):
        prompt - matched > local_prefill_max_tokens -> P+D  "increment_too_large"
        otherwise                                   -> D    "decode_snapshot"
    the decode worker's own match then decides (Serve): a stale view ends in
    LocalPrefillDeclined before anything is computed, and the request goes P+D
    ("worker_declined").

`LocalAttempt` is the D-alone counterpart of the orchestrator's `_Attempt`: one Serve stream
whose first message carries the first token (no retry past it) and cached_tokens; any exit
before the finish aborts the worker (an answer the client stopped still ends with its summary).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

from baton.config.router import RouterConfig
from baton.contract import (
    DecodeChunk,
    FinishReason,
    GenerateChunk,
    GenerateInput,
    GenerateSummary,
    ServeInput,
    WorkerView,
)
from baton.errors import RequestCancelled, WorkerBusy, WorkerFailed
from baton.model.detokenizer import IncrementalDetokenizer
from router.samples import fan_out

log = logging.getLogger(__name__)

LOCAL, DISAGGREGATED = "decode_only", "prefill_decode"
"""Path labels: on the decode worker alone, or through a prefill worker."""


class PathCounts:
    """Requests by (path, reason), for the router's metrics; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def add(self, path: str, reason: str) -> None:
        with self._lock:
            self._counts[(path, reason)] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


def decide(prompt_len: int, matched: Mapping[str, int], decode: Sequence[WorkerView],
           preferred: WorkerView, config: RouterConfig) -> tuple[WorkerView | None, str]:
    """The decode worker to serve the request alone (None: through a prefill worker), and why."""
    limit = config.local_prefill_max_tokens
    if limit == 0:
        return None, "disabled"
    holders = [w for w in decode if matched.get(w.worker_id, 0) > 0]
    if not holders:
        return None, "no_decode_snapshot"
    floor = min(w.busy for w in decode) + config.prefix_load_slack
    holders = [w for w in holders if w.busy <= floor]
    if not holders:
        return None, "decode_busy"
    best = min(holders, key=lambda w: (-matched[w.worker_id], w.worker_id != preferred.worker_id,
                                       *w.load_key()))
    if prompt_len - matched[best.worker_id] > limit:
        return None, "increment_too_large"
    return best, "decode_snapshot"


class LocalAttempt:
    """The request on one decode worker alone; aborts it unless it finished."""

    def __init__(self, orch, rid: str, wid: str, prompt: tuple[int, ...], inp: GenerateInput,
                 decode: WorkerView, cancel):
        self.orch, self.rid, self.wid, self.prompt, self.inp = orch, rid, wid, prompt, inp
        self.d, self.cancel = decode, cancel
        self.dc = orch.clients(decode)
        self._stream: Iterator[DecodeChunk] | None = None
        self._lock = threading.Lock()
        self._aborted = False
        tok = orch.tokenizer
        self._detok = IncrementalDetokenizer(tok) if tok is not None else None

    def count(self) -> None:
        """Counts the attempt on its decode worker (until `_finish`); `start` follows at once."""
        self.orch.registry.begin(self.d.worker_id)

    def start(self) -> DecodeChunk:
        """Opens the Serve stream and waits for its first message (the first token)."""
        inp = self.inp
        req = ServeInput(self.wid, self.prompt, inp.sampling, inp.session_id,
                         self.orch.config.local_prefill_max_tokens)
        try:
            with self.cancel.hook(self._abort_in_background):
                self._stream = self.dc.serve(req, self.cancel)
                first = next(self._stream, None)
                if self.cancel.cancelled:
                    raise RequestCancelled(f"request {self.rid} cancelled during Serve")
            if first is None:
                raise WorkerFailed(self.d.worker_id, "Serve", "stream ended before a token")
            return first
        except WorkerBusy as e:
            self._finish(abort=e.worker_id != self.d.worker_id or self.cancel.cancelled)
            raise
        except BaseException:
            self._finish(abort=True)
            raise

    def stream(self, first: DecodeChunk, start: float, retries: int) -> Iterator[GenerateChunk]:
        if self.inp.sampling.n > 1:
            yield from self._samples(first, start, retries)
            return
        finished = False
        try:
            ttft_ms = (time.perf_counter() - start) * 1000
            cached = first.cached_tokens
            chunk = first
            output: list[int] = []
            while True:
                finished = chunk.finish_reason is not None
                output.extend(chunk.token_ids)
                if finished:
                    self.orch.turn_ended(self.d, self.prompt + tuple(output),
                                         chunk.snapshot_tokens)
                    self._spec = (chunk.draft_tokens, chunk.accepted_tokens)
                yield self._chunk(chunk, cached, start, ttft_ms, retries)
                if finished:
                    return
                chunk = self._next()
                if chunk is None and self.cancel.stopped:
                    # the client ended the answer (a stop string): Serve was cancelled and the
                    # worker is aborted below, but the request still ends with its summary
                    summary = self._summary(FinishReason.STOP, cached, start, ttft_ms, retries)
                    yield GenerateChunk(self.rid, (), "", summary)
                    return
                if chunk is None:
                    raise WorkerFailed(self.d.worker_id, "Serve",
                                       "stream ended without a finish_reason")
        finally:
            self._finish(abort=not finished)

    def _samples(self, first: DecodeChunk, start: float,
                 retries: int) -> Iterator[GenerateChunk]:
        """n > 1: the Serve stream carries every sample's chunks (router/samples.py)."""
        ttft_ms = (time.perf_counter() - start) * 1000
        cached = first.cached_tokens

        def chunks():
            yield first
            yield from self._stream

        def ended(output: tuple[int, ...], snapshot_tokens: int) -> None:
            self.orch.turn_ended(self.d, self.prompt + output, snapshot_tokens)

        finished = False
        try:
            yield from fan_out(self.rid, self.inp.sampling.n, self.orch.tokenizer, self.cancel,
                               chunks(), lambda r: self._summary(r, cached, start, ttft_ms,
                                                                 retries),
                               lambda i: self.dc.abort(self.wid, i), self.d.worker_id,
                               on_end=ended)
            finished = True
        finally:
            self._finish(abort=not finished)

    def _chunk(self, c: DecodeChunk, cached: int, start, ttft_ms, retries) -> GenerateChunk:
        reason: FinishReason | None = c.finish_reason
        text = ""
        if self._detok is not None:
            text = self._detok.push(c.token_ids)
            if reason is not None:
                text += self._detok.flush()
        summary = None
        if reason is not None:
            summary = self._summary(reason, cached, start, ttft_ms, retries)
        return GenerateChunk(self.rid, tuple(c.token_ids), text, summary, c.logprobs)

    def _next(self) -> DecodeChunk | None:
        """The stream's next message; None at its end, or once the client stopped the answer."""
        if self.cancel.stopped:
            return None
        try:
            return next(self._stream, None)
        except (RequestCancelled, WorkerFailed):
            if self.cancel.stopped:
                return None
            raise

    def _summary(self, reason: FinishReason, cached: int, start, ttft_ms,
                 retries) -> GenerateSummary:
        return GenerateSummary(
            finish_reason=reason, prompt_tokens=len(self.prompt), cached_tokens=cached,
            prefill_worker="", decode_worker=self.d.worker_id, ttft_ms=ttft_ms,
            latency_ms=(time.perf_counter() - start) * 1000, retries=retries,
            **spec_counts(getattr(self, "_spec", None)),
        )

    def _finish(self, abort: bool) -> None:
        if abort:
            self._abort_once()
        if self._stream is not None:
            self._stream.close()  # cancels the call if it is still open
        self.orch.registry.end(self.d.worker_id)
        self.orch.queue.capacity_freed()

    def _abort_once(self) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        self.dc.abort(self.wid)

    def _abort_in_background(self) -> None:
        """Cancelled before the first token: abort now; `_finish` aborts again once Serve
        returned, as `_Attempt._abort_in_background` says."""
        threading.Thread(target=self.dc.abort, args=(self.wid,), name=f"abort-{self.rid}",
                         daemon=True).start()


def spec_counts(counts: tuple[int, int] | None) -> dict[str, int]:
    """The decode worker's (draft_tokens, accepted_tokens) as GenerateSummary fields."""
    if counts is None:
        return {}
    return {"draft_tokens": counts[0], "accepted_tokens": counts[1]}
