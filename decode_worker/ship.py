"""HoldSnapshot: this decode worker's decode-end snapshot of a finished turn, held for a
prefill worker to pull back (PullSnapshot, a one-sided READ through the transfer layer), so
that a later turn routed through that prefill worker restores the whole turn.

    hold(tokens)          on the loop thread: cache.hold_snapshot copies the snapshot's state
                          into a fresh live slot and locks its blocks (gone -> SnapshotGone);
                          with 16-bit state it is narrowed into a staging snapshot-pool slot
                          too, and read from there: half the bytes (docs/state-precision.md)
                          -> a signed Reservation naming this worker's transfer endpoint,
                          blocks and slot: the prefill worker reads from there
    release(rid)          the router's Abort once the pull is over, or the lease's end

While a hold is out the transport is polled often (the receiver's `serve_reads`): a one-sided
READ progresses only when this side calls into it. Holds are background work: at most
MAX_HOLD_SHARE of worker.max_num_seqs at once, so that copy-back never takes the live room a
new turn needs (a refused hold costs only that shipment; a later turn's covers it).
"""

from __future__ import annotations

import logging
import threading

from baton.auth import ClusterSecret
from baton.auth.reservations import sign_reservation
from baton.contract import Reservation, ReserveInput
from baton.engine.loop import EngineLoop
from baton.errors import CapacityError, SnapshotGone

log = logging.getLogger("baton.decode")

MAX_HOLD_SHARE = 0.25
"""Snapshot holds a decode worker keeps at once, as a share of worker.max_num_seqs (at least
one)."""


class SnapshotHolds:
    def __init__(self, loop: EngineLoop, receiver, worker_id: str, lease_seconds: float,
                 secret: ClusterSecret | None):
        self.loop, self.receiver, self.worker_id = loop, receiver, worker_id
        self.lease_seconds, self.secret = lease_seconds, secret
        self._lock = threading.Lock()
        self._held: dict[str, threading.Timer] = {}
        self._claiming = 0
        """Holds being taken now (counted against the limit before the loop has them)."""
        self.holds = 0

    def hold(self, inp: ReserveInput) -> Reservation:
        rid, tokens = inp.request_id, list(inp.prompt_ids)
        engine = self.loop.engine
        cap = max(1, int(engine.cfg.max_num_seqs * MAX_HOLD_SHARE))
        with self._lock:
            if len(self._held) + self._claiming >= cap:
                raise CapacityError(f"this decode worker holds {len(self._held)} snapshots for "
                                    f"pulls already, its limit ({MAX_HOLD_SHARE:g} of "
                                    f"worker.max_num_seqs={engine.cfg.max_num_seqs})")
            self._claiming += 1
        try:
            held, slot = self.loop.call(_hold, engine, rid, tokens)
            if held is None:
                raise SnapshotGone(f"this decode worker no longer holds a snapshot of the "
                                   f"{len(tokens)} tokens of {rid}")
            timer = threading.Timer(self.lease_seconds, self.release, args=(rid,))
            timer.daemon = True
            with self._lock:
                self._held[rid] = timer
        finally:
            with self._lock:
                self._claiming -= 1
        timer.start()
        self.receiver.serve_reads(rid, True)
        self.holds += 1
        pools = engine.pools
        res = Reservation(self.worker_id, self.receiver.endpoint,
                          tuple(held.block_table) if pools.has_kv else (),
                          slot if pools.has_state else None, 0, self.lease_seconds,
                          self.receiver.incarnation)
        return sign_reservation(self.secret, rid, res)

    def release(self, request_id: str) -> bool:
        """Frees the hold (the pull is over, or its lease ended); False if none."""
        with self._lock:
            timer = self._held.pop(request_id, None)
        if timer is None:
            return False
        timer.cancel()
        self.receiver.serve_reads(request_id, False)
        try:
            self.loop.call(self.loop.engine.cache.abort, request_id)
        except RuntimeError:  # the loop stopped: shutting down
            pass
        return True

    def tracked(self) -> dict[str, int]:
        """Snapshots held for a pull now (Stats `tracked_snapshot_holds`)."""
        with self._lock:
            return {"snapshot_holds": len(self._held)}

    def close(self) -> None:
        with self._lock:
            timers, self._held = list(self._held.values()), {}
        for t in timers:
            t.cancel()


def _hold(engine, rid: str, tokens: list[int]):
    """On the loop thread: (the held snapshot, the slot a pull reads its state from). With a
    16-bit state the state is read in 16 bits, from a staging snapshot-pool slot it is
    narrowed into (lossless: it came from a 16-bit snapshot), half the float32 bytes; else
    (no staging slot free, or float32 state) from the held live slot."""
    held = engine.cache.hold_snapshot(rid, tokens)
    if held is None or not engine.pools.has_state:
        return held, None
    stage = engine.cache.stage(rid) if engine.lands_handoffs else None
    if stage is None:
        return held, held.slot
    engine.pools.copy_slot(held.slot, stage)
    return held, stage
