"""Prefill worker logic: compute the prompt, hand KV + state to the decode worker, free the copy.

Plain Python: `server.py` converts protobuf to these dataclasses and back.

    prefill(inp, destination)
      submit the prompt to the engine          compute starts at once
      destination()                            blocks until the router reserved it (or None)
      layer-wise: engine.stream_layers         the last chunk posts layer i as soon as it is
                                               computed; the handoff ends with the forward
      otherwise: after the first token, plan + post the whole request
      wait for the sender's event               (the decode side has every byte), release
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from baton.auth import ClusterSecret
from baton.auth.reservations import verify_reservation
from baton.contract import (
    ENDED_AT_FIRST_TOKEN,
    FinishReason,
    PrefillInput,
    PrefillResult,
    Reservation,
    Role,
)
from baton.engine.loop import EngineLoop
from baton.engine.request import Request, RequestOutput
from baton.errors import InvalidRequestError, RequestCancelled, TransferError
from baton.worker import phases as ph
from baton.worker.events import EventRouter
from baton.worker.metrics import WorkerMetrics

log = logging.getLogger("baton.prefill")

LEASE_SAFETY = 0.8
"""Start a transfer only within this fraction of the destination's lease."""


@dataclass
class HandoffTimings:
    """Where a prefill worker's time goes, for Stats counters and `bench handoff`."""

    handoffs: int = 0
    streamed_handoffs: int = 0
    """Handoffs whose layers left during the last chunk's forward (layer-wise)."""
    compute_s_total: float = 0.0
    """Submit to first token (queueing + prompt compute)."""
    handoff_s_total: float = 0.0
    """First token to the decode side's acknowledgement (descriptors, post, copy, notify)."""
    tail_s_total: float = 0.0
    """Layer-wise: the last layer computed to the decode side's acknowledgement."""
    last_compute_ms: float = 0.0
    last_handoff_ms: float = 0.0
    last_tail_ms: float = 0.0
    handoff_bytes_total: int = 0
    """Bytes written by this worker's handoffs (KV and state)."""
    handoff_state_bytes_total: int = 0
    """Of those, the recurrent state's (half the float32 bytes with 16-bit state)."""
    last_handoff_bytes: int = 0
    last_handoff_state_bytes: int = 0

    def add(self, compute_s: float, handoff_s: float, tail_s: float | None) -> None:
        self.handoffs += 1
        self.compute_s_total += compute_s
        self.handoff_s_total += handoff_s
        self.last_compute_ms, self.last_handoff_ms = compute_s * 1000, handoff_s * 1000
        if tail_s is not None:
            self.streamed_handoffs += 1
            self.tail_s_total += tail_s
            self.last_tail_ms = tail_s * 1000

    def add_bytes(self, nbytes: int | None, state_bytes: int) -> None:
        self.handoff_bytes_total += nbytes or 0
        self.handoff_state_bytes_total += state_bytes
        self.last_handoff_bytes, self.last_handoff_state_bytes = nbytes or 0, state_bytes

    def counters(self) -> dict[str, float]:
        return {k: float(v) for k, v in vars(self).items()}


class _Stream:
    """Engine-side half of a handoff that starts inside the last chunk's forward (runs on the
    engine loop thread). Layer-wise: each layer is posted as it is computed. Whole (`whole`):
    every layer in one post as soon as the last one is final, before the first token is
    drawn; the prefill worker's own thread then finds it landed, instead of asking the loop
    thread for the post after the first token and waiting for it (issue 53)."""

    def __init__(self, service: PrefillService, request_id: str, dest: Reservation,
                 deadline: float, whole: bool = False):
        self.service, self.rid, self.dest, self.deadline = service, request_id, dest, deadline
        self.whole = whole
        self._final: set[int] = set()
        """Whole: the layers final so far (posted once they are all of this stage's)."""
        self.error: str | None = None
        self.misfit: str | None = None
        """Why the destination cannot hold this prompt (nothing was sent): INVALID_ARGUMENT."""
        self.sent = False
        self.sent_at: float | None = None
        self.nbytes: int | None = None
        self.state_bytes: int = 0
        """Of `nbytes`, the recurrent state's (16-bit when staged)."""
        self.last_layer_at = 0.0

    def begin(self, block_table: list[int], slot: int | None) -> None:
        if time.monotonic() > self.deadline:
            self.error = _late(self.rid, self.dest)
            return
        try:
            self.service._send(self, block_table, slot, layerwise=True)
        except TransferError as e:  # inside the forward: the request fails, not the batch
            self.error = str(e)

    def layers_done(self, layers: list[int]) -> None:
        if not self.sent:
            return
        if self.whole:
            self._final.update(layers)
            if not set(self.service.sender.layout.layers) <= self._final:
                return
            layers = sorted(self._final)
        self.last_layer_at = time.perf_counter()
        self.service.sender.layers_done(self.rid, layers)
        self.service.events.wake()  # once the last layer is posted, the poller goes fast

    def flush(self) -> None:
        """Whole, begun: posts whatever no layer callback posted (a layer the forward never
        reported); nothing when every layer went out already."""
        if self.sent and self.whole:
            self.service.sender.layers_done(self.rid, list(self.service.sender.layout.layers))


class PrefillService:
    def __init__(self, loop: EngineLoop, sender, worker_id: str, layerwise: bool = False,
                 secret: ClusterSecret | None = None, metrics: WorkerMetrics | None = None):
        self.loop = loop
        self.metrics = metrics or WorkerMetrics(Role.PREFILL, loop)
        self.secret = secret
        """Verifies every destination before anything is written into it."""
        self.sender = sender
        self.worker_id = worker_id
        self.layerwise = layerwise
        """Stream each layer of the last chunk as it is computed (`transfer.layerwise`)."""
        self.post_in_forward = getattr(sender, "streams_layers", True)
        """Whole requests: post at the end of the last chunk's forward, on the loop thread
        (False for senders that cannot hold a post until its layers are final)."""
        self.events = EventRouter(sender.poll, sender.poll_interval)
        self.transfers_done = 0
        self.timings = HandoffTimings()
        self.snapshots = None
        """PullSnapshot (prefill_worker/snapshots.py), set by the role's `attach`."""

    def prefill(self, inp: PrefillInput,
                destination: Callable[[], Reservation | None] = lambda: None) -> PrefillResult:
        """Compute `inp` and hand it off; `destination()` blocks until the router reserved it
        (only asked when `inp` carries none) and returns None if it never will. The result's
        `phases_ms` says where the time went (baton/worker/phases.py)."""
        clock = ph.Clock()
        arrived = time.monotonic()
        req = Request(inp.request_id, list(inp.prompt_ids), inp.sampling,
                      inp.session_id or None, prefill_only=True)
        result = self._prefill(inp, destination, clock, req)
        clock.mark("end")
        phases = ph.clean({
            "p_dest_wait": clock.ms(None, "dest"),
            "p_claim": clock.ms("dest", "claimed"),
            "p_queue": ph.mono_ms(req.arrival, req.prefill_start_time),
            "p_forward": ph.mono_ms(req.prefill_start_time, req.forward_done_time),
            "p_sample": ph.mono_ms(req.forward_done_time, req.first_token_time),
            "p_output": ph.mono_ms(req.first_token_time, clock.at.get("output_mono")),
            "p_post": clock.ms("output", "posted"),
            "p_landed": clock.ms("posted", "landed"),
            "p_wake": clock.ms("landed", "woke"),
            "p_release": clock.ms("woke", "end"),
            "p_total": clock.ms(None, "end"),
        })
        if log.isEnabledFor(logging.DEBUG):
            log.debug(ph.line(inp.request_id, phases))
        # the host's clock at both ends: the router splits its r_rpc with them (same host)
        phases.update({ph.AT_ARRIVAL: arrived * 1000, ph.AT_REPLY: time.monotonic() * 1000})
        return replace(result, phases_ms=phases)

    def _prefill(self, inp: PrefillInput, destination, clock: ph.Clock,
                 req: Request) -> PrefillResult:
        rid = inp.request_id
        if inp.destination is not None:  # known already: nothing is computed for a forgery
            verify_reservation(self.secret, rid, inp.destination)
        box: queue.Queue[RequestOutput] = queue.Queue()
        t0 = time.perf_counter()
        self.loop.submit(req, box.put)
        try:
            dest = inp.destination or destination()
            clock.mark("dest")
        except BaseException:
            self.abort(rid)
            raise
        if dest is None:
            self.abort(rid)
            # a router that gives up cancels the call; a stream that simply ends without a
            # destination is a malformed request
            raise InvalidRequestError(
                f"prefill of {rid}: the stream ended without a destination; send the decode "
                "worker's reservation (DecodeWorker.Reserve) in the first or second message")
        try:  # the compute may already run; not one byte is written before this check
            verify_reservation(self.secret, rid, dest)
            # a first contact's handshake happens here, on this RPC's thread, never on the
            # engine loop thread (where it would stall every request for up to its timeout)
            for endpoint in dest.endpoints:  # every stage of a pipeline-parallel decode worker
                self.sender.connect(endpoint)
            # the right to write the reservation, asked while the prompt computes: the decode
            # side grants it only while the reservation is held, and quarantines a failed one
            # that was granted until the writes are over (transfer/receiver.py)
            self.sender.claim(rid, dest.endpoints, list(dest.block_ids), dest.slot,
                              dest.skip_blocks, dest.incarnation or None)
            clock.mark("claimed")
        except BaseException:
            self.abort(rid)
            raise
        # the decode side's lease runs from its Reserve, just before the destination arrived:
        # past it, the reservation may be freed and reused, so writing into it would corrupt
        # another request
        deadline = time.monotonic() + dest.lease_seconds * LEASE_SAFETY
        # a request that ends at its first token whatever it draws needs no bytes
        whole = not self.layerwise and self.post_in_forward and inp.sampling.max_tokens > 1
        stream = _Stream(self, rid, dest, deadline, whole=whole)
        if self.layerwise or whole:
            self.loop.engine.stream_layers(rid, stream)  # picked up mid-forward if need be
        outs = _last(box)
        clock.mark("output")
        clock.at["output_mono"] = time.monotonic()
        out = outs[0]
        picked = (self.layerwise or whole) and self.loop.engine.take_stream(rid) is None
        streamed = self.layerwise and picked
        t1 = time.perf_counter()
        m, outcome = self.metrics, "failed"
        m.prefill_seconds.labels(m.role).observe(t1 - t0)
        try:
            failed = next((o for o in outs if o.error), None)
            if failed is not None:  # the prompt is shared: no sample can go on without it
                outcome = "aborted" if failed.finish_reason == FinishReason.ABORT else "failed"
                raise TransferError(f"prefill of {rid} failed: {failed.error}")
            m.generation_tokens.labels(m.role).inc(sum(len(o.new_token_ids) for o in outs))
            result = replace(_first(out), prompt_logprobs=out.prompt_logprobs,
                             samples=tuple(_first(o) for o in outs[1:]))
            if all(r.finished for r in result.firsts):
                reason = out.finish_reason
                outcome = reason.value
                # bytes may have gone out (or been granted) for a request that needs none
                self.sender.abort(rid, ENDED_AT_FIRST_TOKEN)
                return result
            if stream.error:
                m.transfer_failed()
                raise TransferError(stream.error)
            if not stream.sent and not stream.misfit:
                if time.monotonic() > deadline:
                    m.transfer_failed()
                    raise TransferError(_late(rid, dest))
                self.loop.call(self._send_whole, stream)
            stream.flush()
            clock.mark("posted")
            if stream.misfit:
                raise InvalidRequestError(stream.misfit)
            self.events.wake()
            landed = self._await_landing(rid, dest)
            now = clock.mark("woke")
            clock.at["landed"] = max(landed, clock.at["posted"])  # it may land before
            # layer-wise, the bytes can land before the forward's last (data-free) layers end
            tail = max(0.0, landed - stream.last_layer_at) if streamed and stream.sent else None
            self.timings.add(t1 - t0, now - t1, tail)
            self.timings.add_bytes(stream.nbytes, stream.state_bytes)
            m.handoff(stream.nbytes, now - (stream.sent_at or t1))
            outcome = "handed_off"
            return result
        except BaseException:
            self.sender.abort(rid, "the prefill worker gave up on the request")
            raise
        finally:
            m.request_ended(outcome)
            self.loop.call(self.loop.engine.release, rid)
            self.events.forget(rid)  # nothing waits for its transfer's event any more

    def abort(self, request_id: str) -> bool:
        # the engine first: once the request left it, no forward starts its transfer (and
        # `_send_whole` refuses), so the sender's abort below is its last word to the decode
        # side; the other way round, a send could claim the reservation anew after it. Its
        # transfer's event is left to `prefill`, which may still be about to wait for it.
        try:
            return self.loop.abort(request_id)
        finally:
            self.sender.abort(request_id)

    def close(self) -> None:
        self.events.stop()
        self.sender.close()

    # -- internals ------------------------------------------------------------------------

    def _send_whole(self, stream: _Stream) -> None:
        """On the loop thread: the whole request at once (its prompt is complete)."""
        cache = self.loop.engine.cache
        if stream.rid not in cache.live_requests():  # aborted meanwhile (the router gave up)
            raise RequestCancelled(f"prefill of {stream.rid} was aborted before its transfer")
        blocks = cache.block_table(stream.rid) if cache.pools.has_kv else []
        slot = cache.slot(stream.rid) if cache.pools.has_state else None
        if slot is not None and self._wants_16bit(stream.dest):
            self.loop.engine.stage_whole(stream.rid)  # (the streamed path stages layer by layer)
        self._send(stream, list(blocks), slot, layerwise=False)

    def _send(self, stream: _Stream, blocks: list[int], slot: int | None,
              layerwise: bool) -> None:
        dest = stream.dest
        stream.misfit = _misfit(stream.rid, dest, len(blocks))
        if stream.misfit:  # a genuine reservation made for another prompt: nothing is written
            return
        if slot is not None and self._wants_16bit(dest):
            slot = self._staged(stream.rid, dest)
        stream.sent_at = time.perf_counter()
        self.sender.send(stream.rid, dest.endpoints, list(blocks), slot,
                         list(dest.block_ids), dest.slot, skip_blocks=dest.skip_blocks,
                         incarnation=dest.incarnation or None, layerwise=layerwise,
                         handshake=False)
        stream.sent = True
        layout = self.sender.layout
        stream.nbytes = handoff_bytes(layout, len(blocks) - dest.skip_blocks, slot)
        stream.state_bytes = handoff_bytes(layout, 0, slot)
        self.events.wake()

    def _wants_16bit(self, dest: Reservation) -> bool:
        """Whether the destination's slot is a snapshot-pool slot of its decode stages: the
        decode worker receives the rounded state in 16 bits there (docs/state-precision.md)."""
        if dest.slot is None:
            return False
        for ep in dest.endpoints:  # handshaken on the RPC thread (never here: loop thread)
            layout = getattr(self.sender, "peer_layout", lambda _: None)(ep)
            st = layout.state if layout is not None else None
            if st is not None and dest.slot >= st.num_slots:
                return True
        return False

    def _staged(self, rid: str, dest: Reservation) -> int:
        """The slot holding this request's prompt-end state narrowed to 16 bits (loop
        thread); TransferError, before a byte moves, when it cannot be had."""
        engine = self.loop.engine
        req = engine.requests.get(rid)
        if req is None or engine.rounding is None or req.prompt_len not in req.round_points:
            raise TransferError(
                f"decode worker {dest.worker_id} receives 16-bit state but this prefill worker "
                f"does not round the prompt end of {rid} (set cache.state_dtype and "
                "cache.mamba_state_config the same on both); nothing was sent")
        stage = engine.cache.staged(rid)
        if stage is None:
            raise TransferError(
                f"decode worker {dest.worker_id} receives 16-bit state but this prefill worker "
                f"has no snapshot slot to stage {rid} in (every one stages a handoff; raise "
                "cache.num_state_slots); nothing was sent")
        return stage

    def _await_landing(self, rid: str, dest: Reservation) -> float:
        """Waits for the decode side's acknowledgement; returns when it was seen."""
        ev, seen = self.events.wait_timed(rid, dest.lease_seconds)
        if ev is None or not ev.ok:
            self.metrics.transfer_failed()
        if ev is None:
            raise TransferError(
                f"transfer of {rid} to {dest.worker_id} did not finish within its "
                f"{dest.lease_seconds:.0f}s lease"
            )
        if not ev.ok:
            raise TransferError(f"transfer of {rid} to {dest.worker_id} failed: {ev.error}")
        self.transfers_done += 1
        return seen


def _last(box: queue.Queue[RequestOutput]) -> list[RequestOutput]:
    """The request's first-token outputs, one per sample in sample order (an error or abort
    output alone when the request failed before its first tokens)."""
    outs: dict[int, RequestOutput] = {}
    while True:
        out = box.get()
        if not out.finished:
            continue
        if out.error and not outs:
            return [out]
        outs[out.sample] = out
        if not out.open_samples:
            return [outs[i] for i in sorted(outs)]


def _first(out: RequestOutput) -> PrefillResult:
    """One sample's first token as the reply carries it (prompt_logprobs set apart)."""
    reason = out.finish_reason
    return PrefillResult(out.new_token_ids[0], out.cached_tokens, reason is not None, reason,
                         out.logprobs[0] if out.logprobs else None)


def _misfit(rid: str, dest: Reservation, num_blocks: int) -> str | None:
    """Why `dest` cannot take this prompt's `num_blocks` KV blocks (the planner's own rule,
    checked before the handoff so that it is the request's fault, not a transfer fault)."""
    if len(dest.block_ids) != num_blocks or not 0 <= dest.skip_blocks <= num_blocks:
        return (f"the destination of {rid} holds {len(dest.block_ids)} KV blocks (skipping "
                f"{dest.skip_blocks}) but its prompt fills {num_blocks}; reserve the destination "
                "for the same prompt (DecodeWorker.Reserve) as the one sent to Prefill")
    return None


def _late(rid: str, dest: Reservation) -> str:
    return (f"prefill of {rid} finished after the destination's {dest.lease_seconds:g}s lease; "
            "not writing into a freed reservation")


def handoff_bytes(layout, num_blocks: int, slot: int | None) -> int:
    """Bytes one handoff writes: `num_blocks` KV blocks of every attention layer, plus every
    declared state tensor of every state layer when a slot moves (this stage's layers)."""
    kv, st = layout.kv, layout.state
    total = len(kv.layers) * kv.block_bytes * num_blocks if kv is not None else 0
    if st is not None and slot is not None:  # a snapshot slot's bytes when staged (16-bit)
        total += len(st.layers) * layout.state_slot_bytes(slot)
    return total
