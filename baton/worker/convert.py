"""Both worker roles: finish reasons to protobuf, errors to gRPC status codes."""

from __future__ import annotations

import grpc

from baton.errors import CapacityError, InvalidRequestError, TransferError
from baton.proto_gen import baton_pb2

FINISH_TO_PB = {
    None: baton_pb2.FINISH_REASON_UNSPECIFIED,
    "length": baton_pb2.FINISH_REASON_LENGTH,
    "stop": baton_pb2.FINISH_REASON_STOP,
    "abort": baton_pb2.FINISH_REASON_ABORT,
    "error": baton_pb2.FINISH_REASON_ABORT,
}

STATUS_OF = {
    InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    TransferError: grpc.StatusCode.UNAVAILABLE,
}


def abort_with(context: grpc.ServicerContext, err: Exception):
    """Ends the RPC with the status that matches `err` (INTERNAL for the unexpected)."""
    for cls, code in STATUS_OF.items():
        if isinstance(err, cls):
            context.abort(code, str(err))
    context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
