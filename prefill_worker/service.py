"""Prefill worker logic: compute the prompt, hand KV + state to the decode worker, free the copy.

Plain Python: `server.py` converts protobuf to these dataclasses and back.
"""

from __future__ import annotations

import logging
import queue
import time

from baton.auth import ClusterSecret
from baton.auth.reservations import verify_reservation
from baton.contract import PrefillInput, PrefillResult, Reservation
from baton.engine.loop import EngineLoop
from baton.engine.request import Request, RequestOutput
from baton.errors import TransferError
from baton.worker.events import EventRouter

log = logging.getLogger("baton.prefill")

LEASE_SAFETY = 0.8
"""Start a transfer only within this fraction of the destination's lease."""


class PrefillService:
    def __init__(self, loop: EngineLoop, sender, worker_id: str,
                 secret: ClusterSecret | None = None):
        self.loop = loop
        self.secret = secret
        """Verifies every destination before anything is computed or written."""
        self.sender = sender
        self.worker_id = worker_id
        self.events = EventRouter(sender.poll, sender.poll_interval)
        self.transfers_done = 0

    def prefill(self, inp: PrefillInput) -> PrefillResult:
        request_id, dest = inp.request_id, inp.destination
        verify_reservation(self.secret, request_id, dest)  # NotPermittedError: nothing moves
        # the decode side's lease runs from its Reserve, just before this call: past it, the
        # reservation may be freed and reused, so writing into it would corrupt another request
        deadline = time.monotonic() + dest.lease_seconds * LEASE_SAFETY
        req = Request(request_id, list(inp.prompt_ids), inp.sampling, inp.session_id or None,
                      prefill_only=True)
        out = self._compute(req)
        if out.error:
            raise TransferError(f"prefill of {request_id} failed: {out.error}")
        reason = out.finish_reason
        result = PrefillResult(out.new_token_ids[0], out.cached_tokens, reason is not None, reason)
        try:
            if not result.finished:
                if time.monotonic() > deadline:
                    raise TransferError(
                        f"prefill of {request_id} finished after the destination's "
                        f"{dest.lease_seconds:g}s lease; not writing into a freed reservation"
                    )
                self._hand_off(request_id, dest)
        finally:
            self.loop.call(self.loop.engine.release, request_id)
        return result

    def abort(self, request_id: str) -> bool:
        self.events.forget(request_id)
        return self.loop.abort(request_id)

    def close(self) -> None:
        self.events.stop()
        self.sender.close()

    def _compute(self, req: Request) -> RequestOutput:
        box: queue.Queue[RequestOutput] = queue.Queue()
        self.loop.submit(req, box.put)
        out = box.get()
        while not out.finished:
            out = box.get()
        return out

    def _hand_off(self, request_id: str, dest: Reservation) -> None:
        engine = self.loop.engine

        def start():
            cache = engine.cache
            blocks = cache.block_table(request_id) if cache.pools.has_kv else []
            slot = cache.slot(request_id) if cache.pools.has_state else None
            self.sender.send(
                request_id, dest.transfer_endpoint, list(blocks), slot,
                list(dest.block_ids), dest.slot, skip_blocks=dest.skip_blocks,
                incarnation=dest.incarnation or None,
            )

        self.loop.call(start)
        self.events.wake()
        ev = self.events.wait(request_id, dest.lease_seconds)
        if ev is None:
            raise TransferError(
                f"transfer of {request_id} to {dest.worker_id} did not finish within its "
                f"{dest.lease_seconds:.0f}s lease"
            )
        if not ev.ok:
            raise TransferError(f"transfer of {request_id} to {dest.worker_id} failed: {ev.error}")
        self.transfers_done += 1
