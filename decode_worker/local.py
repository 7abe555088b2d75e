"""Conditional disaggregation on the decode worker: serve a request alone, prompt included.

    serve(inp)
      on the loop thread, between two steps:
        room for one more request?           no  -> CapacityError (the router tries elsewhere)
        own match: prompt - cached_prefix    > max_uncached_tokens -> LocalPrefillDeclined
        submit the whole request             the engine's admit restores the same snapshot
      the engine prefills the increment in chunks within `worker.max_batch_tokens` per step,
      beside the decodes already running, then decodes; every token streams back, the first
      chunk carrying cached_tokens (what admit restored)

The router's view of this worker's snapshots may be stale: the match here decides. A snapshot
whose KV blocks were evicted is never matched (the tree drops it with its blocks).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator
from dataclasses import replace

from baton.contract import DecodeChunk, ServeInput
from baton.engine.loop import EngineLoop
from baton.engine.request import Request, RequestOutput
from baton.errors import CapacityError, LocalPrefillDeclined
from baton.worker.metrics import WorkerMetrics
from decode_worker.samples import closes, drain_samples

log = logging.getLogger("baton.decode")


class LocalServe:
    """Requests this decode worker prefills itself; `requests` / `declined` count them."""

    def __init__(self, loop: EngineLoop, metrics: WorkerMetrics, drain):
        self.loop, self.metrics, self._drain = loop, metrics, drain
        self.requests = 0
        self.declined = 0

    def serve(self, inp: ServeInput) -> Iterator[DecodeChunk]:
        rid = inp.request_id
        box: queue.Queue[RequestOutput] = queue.Queue()
        req = Request(rid, list(inp.prompt_ids), inp.sampling, inp.session_id or None)
        self.loop.engine.grammars.prepare(inp.sampling.grammar)  # here, not on the loop thread
        self.loop.call_watching(rid, box.put, self._admit, req, inp.max_uncached_tokens)
        if inp.sampling.n > 1:
            yield from self._samples(rid, box)
            return
        first, ended = True, False
        try:
            while True:
                chunk, last = self._drain(box)
                if last.error and last.finished:
                    self.metrics.request_ended("failed")
                    ended = True
                    raise RuntimeError(last.error)
                self.metrics.generation_tokens.labels(self.metrics.role).inc(len(chunk.token_ids))
                if first:
                    chunk = replace(chunk, cached_tokens=last.cached_tokens)
                    first = False
                if last.finished:
                    self.metrics.request_ended(last.finish_reason.value)
                    ended = True
                yield chunk
                if last.finished:
                    return
        finally:
            if not ended:
                self.metrics.request_ended("aborted")
            self.loop.abort(rid)  # no-op when finished; frees on client cancel

    def _samples(self, rid: str, box: queue.Queue[RequestOutput]) -> Iterator[DecodeChunk]:
        """A request forked into n samples after its prompt: each sample's chunks, each
        ending on its own; the first drain carries cached_tokens on every sample's chunk."""
        first, ended = True, False
        try:
            while not ended:
                for chunk, last in drain_samples(box):
                    self.metrics.generation_tokens.labels(self.metrics.role).inc(
                        len(chunk.token_ids))
                    if first:
                        chunk = replace(chunk, cached_tokens=last.cached_tokens)
                    if closes(last):
                        self.metrics.request_ended(
                            "failed" if last.error and last.finish_reason != "abort"
                            else last.finish_reason.value)
                        ended = True
                    yield chunk
                first = False
        finally:
            if not ended:
                self.metrics.request_ended("aborted")
            self.loop.abort(rid)  # no-op when finished; frees on client cancel

    def _admit(self, req: Request, max_uncached: int) -> None:
        """On the loop thread: refuse what this worker cannot hold or should not compute."""
        engine = self.loop.engine
        engine.validate(req.prompt_ids, req.sampling)  # what it can never hold: INVALID_ARGUMENT
        running = len(engine.scheduler.running) + len(engine.scheduler.waiting)
        reserved = sum(1 for r in engine.requests.values() if r not in engine.scheduler.running
                       and r not in engine.scheduler.waiting)
        n = req.sampling.n
        if running + reserved + n > engine.cfg.max_num_seqs or engine.cache.live_room() < n:
            # live_room also counts snapshots held for a pull and quarantined slots
            raise CapacityError(f"decode worker is full ({engine.cfg.max_num_seqs} requests)")
        need = engine.scheduler.blocks_needed(req)
        if need and not engine.cache.can_allocate(engine.scheduler.outstanding_blocks() + need):
            raise CapacityError(f"decode worker has no room for {need} KV blocks")
        cached = engine.cache.cached_prefix(req.prompt_ids)
        left = req.prompt_len - cached
        if left > max_uncached:
            self.declined += 1
            raise LocalPrefillDeclined(
                f"request {req.id}: this decode worker holds a snapshot of {cached} of its "
                f"{req.prompt_len} prompt tokens, leaving {left} to compute, over the router's "
                f"router.local_prefill_max_tokens={max_uncached}"
            )
        self.requests += 1
        engine.add_request(req)
