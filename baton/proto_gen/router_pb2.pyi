from baton.proto_gen import baton_pb2 as _baton_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_ids", "sampling", "session_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _baton_pb2.SamplingParams
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_baton_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "prompt_tokens", "cached_tokens", "prefill_worker", "decode_worker", "ttft_ms", "latency_ms", "retries", "logprobs", "prompt_logprobs", "draft_tokens", "accepted_tokens", "sample")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _baton_pb2.FinishReason
    prompt_tokens: int
    cached_tokens: int
    prefill_worker: str
    decode_worker: str
    ttft_ms: float
    latency_ms: float
    retries: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_baton_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_baton_pb2.TokenLogprob]
    draft_tokens: int
    accepted_tokens: int
    sample: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_baton_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., latency_ms: _Optional[float] = ..., retries: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_baton_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_baton_pb2.TokenLogprob, _Mapping]]] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., sample: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: _baton_pb2.WorkerRole
    def __init__(self, role: _Optional[_Union[_baton_pb2.WorkerRole, str]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "load", "seconds_since_heartbeat", "inflight", "tracked_snapshots", "tokens_per_block", "max_model_len")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    TRACKED_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _baton_pb2.WorkerRole
    address: str
    load: _baton_pb2.WorkerLoad
    seconds_since_heartbeat: float
    inflight: int
    tracked_snapshots: int
    tokens_per_block: int
    max_model_len: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_baton_pb2.WorkerRole, str]] = ..., address: _Optional[str] = ..., load: _Optional[_Union[_baton_pb2.WorkerLoad, _Mapping]] = ..., seconds_since_heartbeat: _Optional[float] = ..., inflight: _Optional[int] = ..., tracked_snapshots: _Optional[int] = ..., tokens_per_block: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ListWorkersReply(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "role", "address", "load", "tokens_per_block", "max_model_len", "stages")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _baton_pb2.WorkerRole
    address: str
    load: _baton_pb2.WorkerLoad
    tokens_per_block: int
    max_model_len: int
    stages: _containers.RepeatedCompositeFieldContainer[StageInfo]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_baton_pb2.WorkerRole, str]] = ..., address: _Optional[str] = ..., load: _Optional[_Union[_baton_pb2.WorkerLoad, _Mapping]] = ..., tokens_per_block: _Optional[int] = ..., max_model_len: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StageInfo, _Mapping]]] = ...) -> None: ...

class StageInfo(_message.Message):
    __slots__ = ("first_layer", "num_layers", "transfer_endpoint")
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    first_layer: int
    num_layers: int
    transfer_endpoint: str
    def __init__(self, first_layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., transfer_endpoint: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("heartbeat_seconds", "eject_after_seconds")
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EJECT_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_seconds: float
    eject_after_seconds: float
    def __init__(self, heartbeat_seconds: _Optional[float] = ..., eject_after_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "load", "snapshot_events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    load: _baton_pb2.WorkerLoad
    snapshot_events: _containers.RepeatedCompositeFieldContainer[_baton_pb2.SnapshotEvent]
    def __init__(self, worker_id: _Optional[str] = ..., load: _Optional[_Union[_baton_pb2.WorkerLoad, _Mapping]] = ..., snapshot_events: _Optional[_Iterable[_Union[_baton_pb2.SnapshotEvent, _Mapping]]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("reregister",)
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    reregister: bool
    def __init__(self, reregister: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
