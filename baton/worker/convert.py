"""Protobuf <-> core dataclasses for both worker roles, and errors -> gRPC status codes."""

from __future__ import annotations

import grpc

from baton.engine.request import SamplingParams
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


def sampling_from_pb(msg: baton_pb2.SamplingParams) -> SamplingParams:
    """Proto defaults (see baton.proto): max_tokens 16, temperature 1.0, top_p 1.0, top_k off."""
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else 16,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def abort_with(context: grpc.ServicerContext, err: Exception):
    """Ends the RPC with the status that matches `err` (INTERNAL for the unexpected)."""
    for cls, code in STATUS_OF.items():
        if isinstance(err, cls):
            context.abort(code, str(err))
    context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
