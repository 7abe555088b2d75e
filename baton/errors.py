"""Error types shared by every role; each maps to one gRPC status at the edges."""


class BatonError(Exception):
    """Base class for errors Baton raises on purpose."""


class InvalidRequestError(BatonError, ValueError):
    """The request itself is bad (maps to INVALID_ARGUMENT)."""


class ConfigError(BatonError, ValueError):
    """A config file or checkpoint is unusable; the message names the field."""


class CapacityError(BatonError, RuntimeError):
    """Pools cannot hold what was asked (maps to RESOURCE_EXHAUSTED)."""


class WorkerBusy(CapacityError):
    """A worker is full for now (it answered RESOURCE_EXHAUSTED); the router tries another
    or queues the request."""

    def __init__(self, worker_id: str, what: str, detail: str):
        super().__init__(f"worker {worker_id} is full ({what}): {detail}")
        self.worker_id = worker_id


class UnknownRequestError(BatonError):
    """The request id names nothing this worker holds (maps to NOT_FOUND)."""


class AuthError(BatonError):
    """The caller did not prove the cluster secret or an API key (maps to UNAUTHENTICATED)."""


class NotPermittedError(BatonError):
    """An authenticated caller asked for something it may not do: a destination its decode
    worker did not sign, a live worker id from another address (maps to PERMISSION_DENIED)."""


class TransferError(BatonError, RuntimeError):
    """A KV/state handoff failed, was refused, or its lease expired."""


class WorkerFailed(BatonError):
    """A worker RPC failed (not because the request was invalid); the pair may be retried."""

    def __init__(self, worker_id: str, what: str, detail: str):
        super().__init__(f"worker {worker_id} failed {what}: {detail}")
        self.worker_id = worker_id


class NoWorkersError(BatonError):
    """No live worker of a needed role (maps to UNAVAILABLE)."""


class RequestCancelled(BatonError):
    """The client cancelled the request; both workers were told to abort."""


class LocalPrefillDeclined(BatonError):
    """A decode worker asked to serve a request alone (conditional disaggregation) found more
    prompt tokens to compute than the router's bound allows (its snapshot was evicted since
    the router's view): nothing was computed; the router sends the request through a prefill
    worker instead (maps to FAILED_PRECONDITION)."""


class SnapshotGone(BatonError):
    """A worker asked to ship a snapshot no longer holds it (evicted since it was reported);
    nothing was written (maps to FAILED_PRECONDITION)."""
