"""Router-side failures; server.py maps each to one gRPC status."""

from __future__ import annotations

from baton.errors import BatonError


class WorkerFailed(BatonError):
    """A worker RPC failed (not because the request was invalid); the pair may be retried."""

    def __init__(self, worker_id: str, what: str, detail: str):
        super().__init__(f"worker {worker_id} failed {what}: {detail}")
        self.worker_id = worker_id


class NoWorkersError(BatonError):
    """No live worker of a needed role (maps to UNAVAILABLE)."""


class RequestCancelled(BatonError):
    """The client cancelled the request; both workers were told to abort."""
