"""The one mapping from Baton's errors to gRPC status codes, for every server and client.

    InvalidRequestError   INVALID_ARGUMENT     the request itself is bad; never retried
    CapacityError         RESOURCE_EXHAUSTED   pools or queue full
    AuthError             UNAUTHENTICATED      no (valid) cluster secret or API key
    NotPermittedError     PERMISSION_DENIED    unsigned destination, worker id takeover
    UnknownRequestError   NOT_FOUND            Decode of a request the worker does not hold
    NoWorkersError        UNAVAILABLE          transient: no live worker of a role
    WorkerFailed          UNAVAILABLE          transient: retried on another worker pair
    TransferError         UNAVAILABLE          transient: the handoff failed or its lease ran out
    RequestCancelled      CANCELLED            the client went away
    LocalPrefillDeclined  FAILED_PRECONDITION  a decode worker will not prefill that much alone
    SnapshotGone          FAILED_PRECONDITION  the snapshot to ship was evicted meanwhile
    anything else         INTERNAL

The HTTP API answers each status with the code in HTTP_STATUS (OpenAI's codes: 400, 429, 503).
"""

from __future__ import annotations

import grpc

from baton.errors import (
    AuthError,
    CapacityError,
    InvalidRequestError,
    LocalPrefillDeclined,
    NotPermittedError,
    NoWorkersError,
    RequestCancelled,
    SnapshotGone,
    TransferError,
    UnknownRequestError,
    WorkerFailed,
)

STATUS_OF = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AuthError: grpc.StatusCode.UNAUTHENTICATED,
    NotPermittedError: grpc.StatusCode.PERMISSION_DENIED,
    UnknownRequestError: grpc.StatusCode.NOT_FOUND,
    NoWorkersError: grpc.StatusCode.UNAVAILABLE,
    WorkerFailed: grpc.StatusCode.UNAVAILABLE,
    TransferError: grpc.StatusCode.UNAVAILABLE,
    RequestCancelled: grpc.StatusCode.CANCELLED,
    LocalPrefillDeclined: grpc.StatusCode.FAILED_PRECONDITION,
    SnapshotGone: grpc.StatusCode.FAILED_PRECONDITION,
}


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}
"""gRPC status -> HTTP status (499: the client closed the request, as nginx logs it)."""


def http_status_of(exc: BaseException) -> int:
    """The HTTP status for `exc` (500 for an error Baton did not raise on purpose)."""
    return HTTP_STATUS.get(status_of(exc) or grpc.StatusCode.INTERNAL, 500)


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status for `exc`, or None for an error Baton did not raise on purpose."""
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return None


MAX_DETAILS_BYTES = 1024
"""Status details travel in trailing metadata, percent-encoded (up to 3 bytes a byte), which
clients cap at 8 KiB by default: a message quoting a huge request id would otherwise turn the
status into the client's own RESOURCE_EXHAUSTED."""


def details_of(err: BaseException | str) -> str:
    """`err`'s message for a status, cut to MAX_DETAILS_BYTES of UTF-8."""
    text = str(err)
    data = text.encode("utf-8", "replace")
    if len(data) <= MAX_DETAILS_BYTES:
        return text
    kept = data[:MAX_DETAILS_BYTES].decode("utf-8", "ignore")
    return f"{kept}... ({len(text) - len(kept)} more characters)"


def abort_with(context: grpc.ServicerContext, err: BaseException):
    """Ends the RPC with the status that matches `err` (INTERNAL for the unexpected)."""
    code = status_of(err)
    if code is None:
        context.abort(grpc.StatusCode.INTERNAL, details_of(f"{type(err).__name__}: {err}"))
    context.abort(code, details_of(err))
