"""Live workers: registration, heartbeats (load + snapshot events), ejection of silent ones."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from baton.contract import Role, SnapshotEvent, WorkerInfo, WorkerLoad, WorkerView
from baton.errors import InvalidRequestError, NotPermittedError


class WorkerListener(Protocol):
    """Told about snapshot events and departures (the routing policy is one)."""

    def observe(self, worker_id: str, events: Sequence[SnapshotEvent]) -> None: ...

    def forget(self, worker_id: str) -> None: ...


@dataclass
class _Record:
    info: WorkerInfo
    load: WorkerLoad
    last_seen: float
    inflight: int = 0


class Registry:
    def __init__(
        self,
        eject_after_seconds: float,
        listeners: Sequence[WorkerListener] = (),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.eject_after_seconds = eject_after_seconds
        self._listeners = list(listeners)
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, _Record] = {}
        self.on_remove: list[Callable[[str], None]] = []
        """Called with the worker id after it left (e.g. to close its channel)."""
        self.on_eject: list[Callable[[str], None]] = []
        """Called with the worker id after it was ejected for silence, before `on_remove`:
        it is unreachable, so calls still waiting on it should fail now."""
        self.ejected = 0
        """Workers ejected for silence since start (a metric)."""

    def add_listener(self, listener: WorkerListener) -> None:
        """Also tell `listener` about snapshot events and departures from now on."""
        self._listeners.append(listener)

    def register(self, info: WorkerInfo) -> None:
        """Adds or replaces a worker; a re-registration starts its snapshot set afresh.

        A live worker's id cannot move to another address (that would hijack its requests);
        once it is silent past eject_after_seconds, or deregistered, the id is free again."""
        if not info.worker_id or not info.address:
            raise InvalidRequestError(f"worker_id and address are required, got {info!r}")
        with self._lock:
            rec = self._workers.get(info.worker_id)
            live = rec is not None and self._clock() - rec.last_seen <= self.eject_after_seconds
            if live and rec.info.address != info.address:
                raise NotPermittedError(
                    f"worker id {info.worker_id!r} is registered and live at another address; "
                    f"a worker keeps its id only from its own address (wait "
                    f"{self.eject_after_seconds:g}s after it stops, or give this worker its "
                    f"own id)"
                )
            known = rec is not None
            self._workers[info.worker_id] = _Record(info, info.load, self._clock())
        if known:
            self._notify_forget(info.worker_id)

    def heartbeat(self, worker_id: str, load: WorkerLoad, events: Sequence[SnapshotEvent]) -> bool:
        """Records load and snapshot events; False when the worker must register again."""
        with self._lock:
            rec = self._workers.get(worker_id)
            if rec is None:
                return False
            rec.load, rec.last_seen = load, self._clock()
        if events:
            for listener in self._listeners:
                listener.observe(worker_id, events)
        return True

    def deregister(self, worker_id: str) -> bool:
        with self._lock:
            found = self._workers.pop(worker_id, None) is not None
        if found:
            self._notify_forget(worker_id)
        return found

    def lost(self, worker_id: str) -> bool:
        """The worker's process died (nothing listens at its address any more): removed now,
        counted as ejected, without waiting eject_after_seconds. A live worker wrongly taken
        for dead is only asked to register again by its next heartbeat."""
        with self._lock:
            found = self._workers.pop(worker_id, None) is not None
            self.ejected += found
        if found:
            self._notify_forget(worker_id)
        return found

    def eject_stale(self) -> list[str]:
        """Removes workers silent longer than eject_after_seconds; returns their ids."""
        now = self._clock()
        with self._lock:
            stale = [
                w for w, r in self._workers.items() if now - r.last_seen > self.eject_after_seconds
            ]
            for w in stale:
                del self._workers[w]
            self.ejected += len(stale)
        for w in stale:
            for callback in self.on_eject:
                callback(w)
            self._notify_forget(w)
        return stale

    def workers(self, role: Role | None = None) -> list[WorkerView]:
        """Live workers (stale ones ejected first), sorted by id."""
        self.eject_stale()
        now = self._clock()
        with self._lock:
            recs = [r for r in self._workers.values() if role is None or r.info.role == role]
            views = [_view(r, now) for r in recs]
        return sorted(views, key=lambda v: v.worker_id)

    def get(self, worker_id: str) -> WorkerView | None:
        with self._lock:
            rec = self._workers.get(worker_id)
            return None if rec is None else _view(rec, self._clock())

    def begin(self, worker_id: str) -> None:
        """Counts a request routed to the worker (until `end`)."""
        with self._lock:
            if worker_id in self._workers:
                self._workers[worker_id].inflight += 1

    def inflight(self) -> int:
        """Requests counted by `begin` and not yet ended, over every live worker."""
        with self._lock:
            return sum(r.inflight for r in self._workers.values())

    def end(self, worker_id: str) -> None:
        with self._lock:
            rec = self._workers.get(worker_id)
            if rec is not None and rec.inflight > 0:
                rec.inflight -= 1

    def _notify_forget(self, worker_id: str) -> None:
        for listener in self._listeners:
            listener.forget(worker_id)
        for callback in self.on_remove:
            callback(worker_id)


def _view(rec: _Record, now: float) -> WorkerView:
    info = rec.info
    return WorkerView(
        worker_id=info.worker_id,
        role=info.role,
        address=info.address,
        tokens_per_block=info.tokens_per_block,
        load=rec.load,
        inflight=rec.inflight,
        seconds_since_heartbeat=now - rec.last_seen,
        max_model_len=info.max_model_len,
    )
