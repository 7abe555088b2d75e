"""Decode worker logic: reserve where prefill writes, wait for the transfer, decode and stream.

Plain Python: `server.py` converts protobuf to these dataclasses and back.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

from baton.auth import ClusterSecret
from baton.auth.reservations import sign_reservation
from baton.contract import (
    ENDED_AT_FIRST_TOKEN,
    DecodeChunk,
    FinishReason,
    Reservation,
    ReserveInput,
    Role,
    ServeInput,
)
from baton.engine.loop import EngineLoop
from baton.engine.request import Request, RequestOutput
from baton.errors import TransferError, UnknownRequestError
from baton.worker import phases as ph
from baton.worker.events import EventRouter
from baton.worker.metrics import WorkerMetrics
from decode_worker.local import LocalServe
from decode_worker.samples import closes, drain_samples

log = logging.getLogger("baton.decode")

# the reason of a transfer this worker ended because its request ended here (the router's
# Abort: the first token finished the request, a stop string, a cancelled client): like
# ENDED_AT_FIRST_TOKEN from the prefill side, nothing was owed, so it is no failure
ABORTED_HERE = "aborted by the decode worker"


def drain_chunk(box: queue.Queue[RequestOutput]) -> tuple[DecodeChunk, RequestOutput]:
    """Waits for the request's next output, then takes every output already queued behind it:
    one stream message carries all tokens that are ready (while the reader is slower than the
    engine, messages grow instead of queueing up). Returns the chunk and the last output."""
    out = box.get()
    tokens, logprobs = list(out.new_token_ids), list(out.logprobs)
    while not out.finished:
        try:
            out = box.get_nowait()
        except queue.Empty:
            break
        tokens.extend(out.new_token_ids)
        logprobs.extend(out.logprobs)
    if not out.finished:
        return DecodeChunk(tuple(tokens), logprobs=tuple(logprobs)), out
    return DecodeChunk(tuple(tokens), out.finish_reason, snapshot_tokens=out.snapshot_tokens,
                       logprobs=tuple(logprobs), draft_tokens=out.draft_tokens,
                       accepted_tokens=out.accepted_tokens), out


class DecodeService:
    def __init__(self, loop: EngineLoop, receiver, worker_id: str, lease_seconds: float,
                 secret: ClusterSecret | None = None, metrics: WorkerMetrics | None = None):
        self.loop = loop
        self.secret = secret
        """Signs every reservation (None: the cluster has no secret; nothing is signed)."""
        self.metrics = metrics or WorkerMetrics(Role.DECODE, loop)
        self.receiver = receiver
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.events = EventRouter(receiver.poll, receiver.poll_interval,
                                  on_failure=self._transfer_failed)
        receiver.on_activity = self.events.wake
        receiver.on_release = self._quarantine_over
        self._leases: dict[str, threading.Timer] = {}
        self._lock = threading.Lock()
        self.local = LocalServe(loop, self.metrics, drain_chunk)
        """Requests served here alone, prompt included (conditional disaggregation)."""
        self.shipper = None
        """HoldSnapshot (decode_worker/ship.py), set by the role's `attach`."""

    def reserve(self, inp: ReserveInput) -> Reservation:
        request_id = inp.request_id
        req = Request(request_id, list(inp.prompt_ids), inp.sampling, inp.session_id or None)
        engine = self.loop.engine

        def do_reserve():
            adm = engine.reserve_remote(req)
            tpb = engine.pools.spec.tokens_per_block
            skip = adm.cached_tokens // tpb if engine.pools.has_kv else 0
            blocks = tuple(adm.block_table) if engine.pools.has_kv else ()
            slot = adm.slot if engine.pools.has_state else None
            if slot is not None and engine.lands_handoffs \
                    and req.prompt_len in engine.rounding.points(req.prompt_len):
                # the prompt end is rounded there: its state lands in 16 bits in a snapshot
                # slot, widened into the live one at start_remote (docs/state-precision.md)
                staged = engine.cache.stage(request_id)
                slot = slot if staged is None else staged
            # prefill writes only the blocks after the shared prefix: those alone are leased
            self.receiver.expect(request_id, list(blocks[skip:]), slot, self.lease_seconds)
            res = Reservation(self.worker_id, self.receiver.endpoint, blocks, slot, skip,
                              self.lease_seconds, self.receiver.incarnation)
            return sign_reservation(self.secret, request_id, res)

        engine.grammars.prepare(inp.sampling.grammar)  # here, not on the engine's thread
        res = self.loop.call(do_reserve)
        self.events.wake()
        self._start_lease(request_id)
        return res

    def decode(self, request_id: str, first_token: int | list[int]) -> Iterator[DecodeChunk]:
        """Yields the new tokens of each step until a chunk with a finish reason (with n > 1
        first tokens: until every sample's chunk with its finish reason)."""
        if not self._end_lease(request_id):  # else it would wait a whole lease for nothing
            raise UnknownRequestError(
                f"request {request_id!r} holds no reservation on this worker (never reserved, "
                "already decoding, aborted, or its lease ran out); Reserve it first")
        self.events.wake()
        clock = ph.Clock()
        ev = self.events.wait(request_id, self.lease_seconds)
        clock.mark("landed")
        if ev is None or not ev.ok:
            self.metrics.transfer_failed()
            self.metrics.request_ended("failed")
            if ev is None:
                self.receiver.abort(request_id, "no transfer within the lease")
            self._free(request_id)
            why = "did not arrive within the lease" if ev is None else ev.error
            raise TransferError(f"prompt state of {request_id} {why}")
        self.metrics.handoff(None, None)
        box: queue.Queue[RequestOutput] = queue.Queue()
        first = self.loop.call_watching(request_id, box.put, self.loop.engine.start_remote,
                                        request_id, first_token)
        clock.mark("admitted")
        if len(first) > 1:
            yield from self._decode_samples(request_id, first, box)
            return
        if first and first[0].finished:
            self.metrics.request_ended(first[0].finish_reason.value)
            yield DecodeChunk((), first[0].finish_reason)
            return
        ended = False
        try:
            while True:
                chunk, last = drain_chunk(box)
                if "first" not in clock.at and log.isEnabledFor(logging.DEBUG):
                    clock.mark("first")
                    log.debug(ph.line(request_id, ph.clean({
                        "d_landed_wait": clock.ms(None, "landed"),
                        "d_admit": clock.ms("landed", "admitted"),
                        "d_first_step": clock.ms("admitted", "first")})))
                self.metrics.generation_tokens.labels(self.metrics.role).inc(
                    len(chunk.token_ids))
                if last.finished:  # counted before the router can see the last chunk
                    self.metrics.request_ended(_outcome(last))
                    ended = True
                yield chunk
                if last.finished:
                    if last.error:
                        raise RuntimeError(last.error)
                    return
        finally:
            if not ended:
                self.metrics.request_ended("aborted")
            self.loop.abort(request_id)  # no-op when finished; frees on client cancel

    def _decode_samples(self, request_id: str, first: list[RequestOutput],
                        box: queue.Queue[RequestOutput]) -> Iterator[DecodeChunk]:
        """Decode of a request forked into samples: each one's chunks, each ending on its own
        (decode_worker/samples.py)."""
        ended = False
        try:
            for out in first:  # samples whose first token ended them
                if out.finished:
                    yield DecodeChunk((), out.finish_reason, sample=out.sample)
            if closes(first[-1]):
                self.metrics.request_ended(_outcome(first[-1]))
                ended = True
            while not ended:
                for chunk, last in drain_samples(box):
                    self.metrics.generation_tokens.labels(self.metrics.role).inc(
                        len(chunk.token_ids))
                    if closes(last):
                        self.metrics.request_ended(_outcome(last))
                        ended = True
                    yield chunk
        finally:
            if not ended:
                self.metrics.request_ended("aborted")
            self.loop.abort(request_id)  # no-op when finished; frees on client cancel

    def abort_sample(self, request_id: str, sample: int) -> bool:
        """One sample of a decoding request with n > 1 (the client ended its answer)."""
        return self.loop.abort_sample(request_id, sample)

    def serve(self, inp: ServeInput) -> Iterator[DecodeChunk]:
        """Conditional disaggregation: the whole request here (decode_worker/local.py)."""
        return self.local.serve(inp)

    def abort(self, request_id: str) -> bool:
        self._end_lease(request_id)
        self.receiver.abort(request_id, ABORTED_HERE)
        self.events.forget(request_id)
        return self._free(request_id)

    def tracked(self) -> dict[str, int]:
        """Per-request bookkeeping sizes (Stats `tracked_*`): reservations waiting for
        Decode (each with a lease timer)."""
        with self._lock:
            return {"leases": len(self._leases)}

    def close(self) -> None:
        self.events.stop()
        self.receiver.close()  # tells connected prefill workers `bye`
        if self.shipper is not None:
            self.shipper.close()

    def _start_lease(self, request_id: str) -> None:
        t = threading.Timer(self.lease_seconds, self._lease_expired, args=(request_id,))
        t.daemon = True
        with self._lock:
            self._leases[request_id] = t
        t.start()

    def _end_lease(self, request_id: str) -> bool:
        """Stops the lease timer; False when `request_id` had no lease."""
        with self._lock:
            t = self._leases.pop(request_id, None)
        if t is not None:
            t.cancel()
        return t is not None

    def _lease_expired(self, request_id: str) -> None:
        with self._lock:
            self._leases.pop(request_id, None)
        self.receiver.abort(request_id, "reservation expired without Decode")  # no new claim
        self.events.forget(request_id)  # its transfer's event, landed or failed: none will ask
        if self._free(request_id):
            log.warning("reservation %s expired after %.1fs without Decode; freed",
                        request_id, self.lease_seconds)

    def _transfer_failed(self, request_id: str, error: str) -> None:
        held = self.receiver.held(request_id)
        # nothing was owed (the request ended at its first token, or here: blocks the prefill
        # may still be writing stay quarantined, routinely): no failure; which of the
        # prefill's and the router's word arrives first is a race
        quiet = (ENDED_AT_FIRST_TOKEN in error and not held) or error == ABORTED_HERE
        log.log(logging.INFO if quiet else logging.WARNING, "transfer into %s failed: %s%s",
                request_id, error,
                    f" (its {len(held.blocks)} blocks stay quarantined until its writes are "
                    "over)" if held else "")
        self._end_lease(request_id)
        self._free(request_id)

    def _free(self, request_id: str) -> bool:
        """Frees a reservation that will not be decoded, except what a failed transfer may
        still write: the receiver's quarantine keeps those blocks and the slot out of
        service until `_quarantine_over`."""

        def hold():
            q = self.receiver.held(request_id)
            return None if q is None else (q.key, sorted(q.blocks), q.slot is not None)

        return self.loop.abort(request_id, hold)

    def _quarantine_over(self, key: str) -> None:
        """Nothing more can land in a quarantine's blocks (receiver's polling thread)."""
        try:
            self.loop.call(self.loop.engine.cache.release_quarantine, key)
        except RuntimeError:  # the loop stopped (shutdown)
            pass


def _outcome(out: RequestOutput) -> str:
    """The metrics label of a finished request: its finish reason, or `failed` on an error."""
    reason = out.finish_reason
    if reason is None or (out.error and reason is not FinishReason.ABORT):
        return "failed"
    return "aborted" if reason is FinishReason.ABORT else reason.value
