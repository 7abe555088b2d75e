"""Delivers transfer events (by request id) from a polling thread to the threads waiting on them.

Without NIXL's own progress thread, the transport moves only when someone polls it, so this
thread polls as often as the transfer endpoint asks (`interval()`): every few hundred
microseconds while writes are in flight, rarely while waiting, never while idle (it sleeps
until `wake()`, with a slow housekeeping tick).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("baton.worker")

KEEP_SECONDS = 600.0
"""How long an unclaimed event is kept for a late waiter."""
HOUSEKEEPING_S = 1.0
"""Poll this often even when idle (peers that said bye, stale notifications)."""


class EventRouter:
    """Polls `poll()` in a thread; `wait(request_id)` blocks until that request's event arrives.

    Events nobody waits for yet are kept (a decode may be requested after its transfer
    landed), except those of requests given up (`forget`): aborting a request makes the
    endpoint queue its failure, which the next poll brings and no new waiter will claim (a
    thread already waiting still gets it). `on_failure` sees failures as they arrive (lease
    expiry frees the reservation).
    """

    def __init__(self, poll: Callable[[], list], interval: Callable[[], float | None],
                 on_failure: Callable[[str, str], None] | None = None):
        self._poll = poll
        self._interval = interval
        self._on_failure = on_failure
        self._woken = threading.Event()
        self._events: dict[str, tuple[object, float, float]] = {}
        """request id -> (event, time.monotonic(), time.perf_counter()) of its arrival."""
        self._waiting: dict[str, int] = {}
        """Request id -> threads waiting for its event now."""
        self._forgotten: dict[str, int] = {}
        """Requests given up -> `_polls` then: their events are dropped until a poll that
        started later has run (it took whatever the endpoint had queued for them)."""
        self._polls = 0
        """Polls started."""
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="transfer-events", daemon=True)
        self._thread.start()

    def wait(self, request_id: str, timeout: float):
        """The event for `request_id`, or None after `timeout` seconds."""
        return self.wait_timed(request_id, timeout)[0]

    def wait_timed(self, request_id: str, timeout: float) -> tuple[object | None, float]:
        """(event or None, time.perf_counter() when the poller saw it)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._waiting[request_id] = self._waiting.get(request_id, 0) + 1
            try:
                while request_id not in self._events:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stop:
                        return None, time.perf_counter()
                    self._cond.wait(left)
                ev, _, seen = self._events.pop(request_id)
                return ev, seen
            finally:
                if self._waiting[request_id] == 1:
                    del self._waiting[request_id]
                else:
                    self._waiting[request_id] -= 1

    def wake(self) -> None:
        """Something was reserved, sent or posted: ask the endpoint how often to poll now."""
        self._woken.set()

    def forget(self, request_id: str) -> None:
        """No new waiter will come for `request_id` (call it after aborting the request at
        the endpoint): its event is dropped, now or when the next poll brings it, unless a
        thread is waiting for it already."""
        with self._cond:
            self._events.pop(request_id, None)
            self._forgotten[request_id] = self._polls

    def tracked(self) -> dict[str, int]:
        """Per-request bookkeeping sizes (worker Stats `tracked_*`)."""
        with self._cond:
            return {"transfer_events": len(self._events),
                    "transfer_events_forgotten": len(self._forgotten),
                    "transfer_waiters": len(self._waiting)}

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._woken.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop:
            with self._cond:
                self._polls += 1
                started = self._polls
            try:
                events = self._poll()
            except Exception:  # noqa: BLE001 - keep polling; the backend logs its own errors
                log.exception("transfer poll failed")
                events = []
            self._deliver(events, started)
            if events:
                continue
            interval = self._interval()
            self._woken.wait(HOUSEKEEPING_S if interval is None else interval)
            self._woken.clear()

    def _deliver(self, events: list, poll: int) -> None:
        """Hands over the events of poll number `poll`."""
        now, seen = time.monotonic(), time.perf_counter()
        with self._cond:
            for ev in events:
                rid = ev.request_id
                if rid not in self._forgotten or rid in self._waiting:
                    self._events[rid] = (ev, now, seen)
            for rid in [r for r, p in self._forgotten.items() if p < poll]:
                del self._forgotten[rid]  # this poll started after it: nothing more comes
            # events nobody claimed (requests never decoded nor aborted) must not pile up
            for rid in [r for r, (_, t, _) in self._events.items() if now - t > KEEP_SECONDS]:
                del self._events[rid]
            if events:
                self._cond.notify_all()
        for ev in events:
            if not ev.ok and self._on_failure is not None:
                self._on_failure(ev.request_id, ev.error or "transfer failed")
