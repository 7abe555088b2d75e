"""Prefill worker logic: compute the prompt, hand KV + state to the decode worker, free the copy.

Plain Python: `server.py` converts protobuf to these dataclasses and back.
"""

from __future__ import annotations

import logging
import queue
import time

from baton.contract import PrefillInput, PrefillResult, Reservation
from baton.engine.loop import EngineLoop
from baton.engine.request import Request, RequestOutput
from baton.errors import TransferError
from baton.worker.events import EventRouter
from baton.worker.metrics import WorkerMetrics

log = logging.getLogger("baton.prefill")

LEASE_SAFETY = 0.8
"""Start a transfer only within this fraction of the destination's lease."""


class PrefillService:
    def __init__(self, loop: EngineLoop, sender, worker_id: str, metrics: WorkerMetrics):
        self.loop = loop
        self.sender = sender
        self.worker_id = worker_id
        self.metrics = metrics
        self.events = EventRouter(sender.poll, sender.poll_interval)
        self.transfers_done = 0

    def prefill(self, inp: PrefillInput) -> PrefillResult:
        request_id, dest = inp.request_id, inp.destination
        # the decode side's lease runs from its Reserve, just before this call: past it, the
        # reservation may be freed and reused, so writing into it would corrupt another request
        deadline = time.monotonic() + dest.lease_seconds * LEASE_SAFETY
        req = Request(request_id, list(inp.prompt_ids), inp.sampling, inp.session_id or None,
                      prefill_only=True)
        t0 = time.perf_counter()
        out = self._compute(req)
        self.metrics.prefill_seconds.labels(self.metrics.role).observe(time.perf_counter() - t0)
        if out.error:
            self.metrics.request_ended("aborted" if out.finish_reason == "abort" else "failed")
            raise TransferError(f"prefill of {request_id} failed: {out.error}")
        self.metrics.generation_tokens.labels(self.metrics.role).inc(len(out.new_token_ids))
        reason = out.finish_reason
        result = PrefillResult(out.new_token_ids[0], out.cached_tokens, reason is not None, reason)
        outcome = reason.value if reason is not None else "failed"
        try:
            if not result.finished:
                if time.monotonic() > deadline:
                    self.metrics.transfer_failed()
                    raise TransferError(
                        f"prefill of {request_id} finished after the destination's "
                        f"{dest.lease_seconds:g}s lease; not writing into a freed reservation"
                    )
                self._hand_off(request_id, dest)
                outcome = "handed_off"
        finally:
            self.metrics.request_ended(outcome)
            self.loop.call(self.loop.engine.release, request_id)
        return result

    def abort(self, request_id: str) -> bool:
        self.events.forget(request_id)
        return self.loop.abort(request_id)

    def close(self) -> None:
        self.events.stop()

    def _compute(self, req: Request) -> RequestOutput:
        box: queue.Queue[RequestOutput] = queue.Queue()
        self.loop.submit(req, box.put)
        out = box.get()
        while not out.finished:
            out = box.get()
        return out

    def _hand_off(self, request_id: str, dest: Reservation) -> None:
        engine = self.loop.engine

        def start() -> int:
            cache = engine.cache
            blocks = cache.block_table(request_id) if cache.pools.has_kv else []
            slot = cache.slot(request_id) if cache.pools.has_state else None
            self.sender.send(
                request_id, dest.transfer_endpoint, list(blocks), slot,
                list(dest.block_ids), dest.slot, skip_blocks=dest.skip_blocks,
            )
            return handoff_bytes(self.sender.layout, len(blocks) - dest.skip_blocks, slot)

        t0 = time.perf_counter()
        nbytes = self.loop.call(start)
        self.events.wake()
        ev = self.events.wait(request_id, dest.lease_seconds)
        if ev is None or not ev.ok:
            self.metrics.transfer_failed()
        if ev is None:
            raise TransferError(
                f"transfer of {request_id} to {dest.worker_id} did not finish within its "
                f"{dest.lease_seconds:.0f}s lease"
            )
        if not ev.ok:
            raise TransferError(f"transfer of {request_id} to {dest.worker_id} failed: {ev.error}")
        self.transfers_done += 1
        self.metrics.handoff(nbytes, time.perf_counter() - t0)


def handoff_bytes(layout, num_blocks: int, slot: int | None) -> int:
    """Bytes one handoff writes: `num_blocks` KV blocks of every attention layer, plus the conv
    and SSM state of every Mamba layer when a slot moves (this stage's layers)."""
    kv, st = layout.kv, layout.state
    total = len(kv.layers) * kv.block_bytes * num_blocks if kv is not None else 0
    if st is not None and slot is not None:
        total += len(st.layers) * (st.conv_bytes + st.ssm_bytes)
    return total
