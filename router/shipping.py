"""The decode-end state shipped back to a prefill worker, in the background after a turn.

A turn that finished on a decode worker left a decode-end snapshot there (prompt + answer).
The next turn usually runs on that decode worker alone (router/conditional.py); but one whose
increment is too long for it goes through a prefill worker, which without this would restore
only what it computed itself (the prompt of the last turn it served) and recompute every turn
since. So, when no prefill worker holds that snapshot yet:

    target: the live prefill worker holding the deepest part of it (ties: least loaded)
    D.HoldSnapshot(tokens)      -> signed Reservation: the held blocks and state slot
    P.PullSnapshot(tokens, src)    one-sided READ of what P lacks (KV blocks past those it
                                   holds, the Mamba state) through the transfer layer; P
                                   commits it as its own snapshot; the router indexes it
    D.Abort                        releases the hold (its lease would otherwise)

At most MAX_INFLIGHT shipments run at once; past that a turn's shipment is skipped (a later
turn's covers it). A failure is logged and costs nothing but the missed reuse. A request about
to go through a prefill worker that a shipment of a prefix of its prompt is still heading to
waits for it (at most WAIT_S): a pull is far cheaper than recomputing the turn it carries.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence

from baton.contract import ReserveInput, Role, SnapshotShipment, WorkerView
from baton.errors import BatonError
from router.cancellation import Cancellation

log = logging.getLogger(__name__)

MAX_INFLIGHT = 32
WAIT_S = 2.0
RELEASE_ATTEMPTS = 3
"""Aborts a shipment sends the decode worker until one releases its hold."""


class DecodeEndShipper:
    def __init__(self, orch):
        self.orch = orch
        self._slots = threading.BoundedSemaphore(MAX_INFLIGHT)
        self._lock = threading.Lock()
        self._inflight: dict[str, list[tuple[tuple[int, ...], threading.Event]]] = {}
        """Per target prefill worker, the snapshots on their way there."""
        self.shipped = self.failed = self.skipped = 0

    @property
    def in_flight(self) -> int:
        """Shipments on their way."""
        with self._lock:
            return sum(len(v) for v in self._inflight.values())

    def wait_for(self, prefill: WorkerView, prompt: Sequence[int]) -> None:
        """Before `prompt` goes through `prefill`: wait (at most WAIT_S) for a shipment of a
        prefix of it still heading there."""
        with self._lock:
            pending = [done for snap, done in self._inflight.get(prefill.worker_id, ())
                       if len(snap) < len(prompt) and tuple(prompt[:len(snap)]) == snap]
        for done in pending:
            done.wait(WAIT_S)

    def after_turn(self, decode: WorkerView, tokens: Sequence[int], num_tokens: int,
                   prefill: WorkerView | None = None) -> None:
        """`decode` now holds a snapshot of `tokens[:num_tokens]`: ship it if no prefill
        worker has it (preferring `prefill`, which computed this turn's prompt, on a tie: its
        heartbeat may not have reported that yet). Returns at once; a thread ships it."""
        if not self.orch.config.ship_decode_end_state or num_tokens <= 0:
            return
        snap = tuple(tokens[:num_tokens])
        target = self._target(snap, prefill.worker_id if prefill is not None else "")
        if target is None:
            return
        if not self._slots.acquire(blocking=False):
            self.skipped += 1
            return
        done = threading.Event()
        with self._lock:
            self._inflight.setdefault(target.worker_id, []).append((snap, done))
        threading.Thread(target=self._ship, args=(decode, target, snap, done), daemon=True,
                         name="ship-decode-end").start()

    def _target(self, snap: tuple[int, ...], preferred: str) -> WorkerView | None:
        prefill = self.orch.registry.workers(Role.PREFILL)
        if not prefill:
            return None
        # a match never covers the last token: probe with one more to see the whole snapshot
        matched = self.orch.locator.matched_tokens(snap + (0,), prefill)
        if any(n >= len(snap) for n in matched.values()):
            return None
        return min(prefill, key=lambda w: (-matched.get(w.worker_id, 0),
                                           w.worker_id != preferred, *w.load_key()))

    def _ship(self, decode: WorkerView, target: WorkerView, snap: tuple[int, ...],
              done: threading.Event) -> None:
        rid = f"ship-{uuid.uuid4().hex}"
        pc, dc = self.orch.clients(target), self.orch.clients(decode)
        cancel = Cancellation()
        try:
            src = dc.hold_snapshot(ReserveInput(rid, snap), cancel)
            n = pc.pull_snapshot(SnapshotShipment(rid, snap, src), cancel)
            self.orch.locator.hint(target, snap, len(snap))
            self.shipped += 1
            log.debug("decode-end snapshot of %d tokens pulled %s -> %s (%d blocks)",
                      len(snap), decode.worker_id, target.worker_id, n)
        except BatonError as e:
            self.failed += 1
            pc.abort(rid)
            log.info("decode-end snapshot of %d tokens not pulled %s -> %s: %s", len(snap),
                     decode.worker_id, target.worker_id, e)
        finally:
            # releases the hold; asked again when nothing was released, since a worker too busy
            # to answer within router.abort_timeout_seconds keeps it until the lease's end
            # (30 s) else (an already released hold just answers False again)
            for _ in range(RELEASE_ATTEMPTS):
                if dc.abort(rid):
                    break
            with self._lock:
                mine = self._inflight.get(target.worker_id, [])
                mine[:] = [x for x in mine if x[1] is not done]
                if not mine:
                    self._inflight.pop(target.worker_id, None)
            done.set()
            self._slots.release()
