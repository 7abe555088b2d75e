from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "n", "grammar", "grammar_replay")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_REPLAY_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    n: int
    grammar: str
    grammar_replay: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., n: _Optional[int] = ..., grammar: _Optional[str] = ..., grammar_replay: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running", "waiting", "free_blocks", "free_slots", "total_blocks", "total_slots")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    free_blocks: int
    free_slots: int
    total_blocks: int
    total_slots: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_blocks: _Optional[int] = ..., free_slots: _Optional[int] = ..., total_blocks: _Optional[int] = ..., total_slots: _Optional[int] = ...) -> None: ...

class SnapshotEvent(_message.Message):
    __slots__ = ("kind", "block_hash", "snapshot_hash", "num_tokens", "tier")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[SnapshotEvent.Kind]
        KIND_INSERTED: _ClassVar[SnapshotEvent.Kind]
        KIND_EVICTED: _ClassVar[SnapshotEvent.Kind]
    KIND_UNSPECIFIED: SnapshotEvent.Kind
    KIND_INSERTED: SnapshotEvent.Kind
    KIND_EVICTED: SnapshotEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    kind: SnapshotEvent.Kind
    block_hash: int
    snapshot_hash: int
    num_tokens: int
    tier: int
    def __init__(self, kind: _Optional[_Union[SnapshotEvent.Kind, str]] = ..., block_hash: _Optional[int] = ..., snapshot_hash: _Optional[int] = ..., num_tokens: _Optional[int] = ..., tier: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "sample")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample: int
    def __init__(self, request_id: _Optional[str] = ..., sample: _Optional[int] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("pool_checksum",)
    POOL_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    pool_checksum: bool
    def __init__(self, pool_checksum: _Optional[bool] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("worker_id", "role", "load", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    load: WorkerLoad
    counters: _containers.ScalarMap[str, float]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., counters: _Optional[_Mapping[str, float]] = ...) -> None: ...
