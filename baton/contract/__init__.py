"""The cross-process contract: plain types here, protobuf conversions in `wire`, status codes in
`status`, snapshot keys in `prefix_hash`."""

from baton.contract.types import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_TOKENS_PER_BLOCK,
    ENDED_AT_FIRST_TOKEN,
    DecodeChunk,
    FinishReason,
    GenerateChunk,
    GenerateInput,
    GenerateSummary,
    PrefillInput,
    PrefillResult,
    Reservation,
    ReserveInput,
    Role,
    ServeInput,
    SnapshotEvent,
    SnapshotShipment,
    StageInfo,
    TokenLogprob,
    WorkerInfo,
    WorkerLoad,
    WorkerView,
)
from baton.sampling import SamplingParams

__all__ = [
    "DEFAULT_LEASE_SECONDS", "DEFAULT_TOKENS_PER_BLOCK", "ENDED_AT_FIRST_TOKEN", "DecodeChunk", "FinishReason",
    "GenerateChunk", "GenerateInput", "GenerateSummary", "PrefillInput", "PrefillResult",
    "Reservation", "ReserveInput", "Role", "SamplingParams", "ServeInput", "SnapshotEvent",
    "SnapshotShipment", "StageInfo", "TokenLogprob", "WorkerInfo", "WorkerLoad", "WorkerView",
]
