from baton.proto_gen import baton_pb2 as _baton_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "session_id", "prompt_le32")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LE32_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _baton_pb2.SamplingParams
    session_id: str
    prompt_le32: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_baton_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., prompt_le32: _Optional[bytes] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("worker_id", "transfer_endpoint", "block_ids", "slot", "skip_blocks", "lease_seconds", "incarnation", "signature")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    transfer_endpoint: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slot: int
    skip_blocks: int
    lease_seconds: float
    incarnation: str
    signature: bytes
    def __init__(self, worker_id: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., slot: _Optional[int] = ..., skip_blocks: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., incarnation: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Destination(_message.Message):
    __slots__ = ("worker_id", "transfer_endpoint", "block_ids", "slot", "skip_blocks", "lease_seconds", "incarnation", "signature")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    transfer_endpoint: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slot: int
    skip_blocks: int
    lease_seconds: float
    incarnation: str
    signature: bytes
    def __init__(self, worker_id: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., slot: _Optional[int] = ..., skip_blocks: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., incarnation: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "session_id", "destination", "prompt_le32")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LE32_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _baton_pb2.SamplingParams
    session_id: str
    destination: Destination
    prompt_le32: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_baton_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., destination: _Optional[_Union[Destination, _Mapping]] = ..., prompt_le32: _Optional[bytes] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token_id", "cached_tokens", "finished", "finish_reason", "logprobs", "prompt_logprobs", "samples")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    cached_tokens: int
    finished: bool
    finish_reason: _baton_pb2.FinishReason
    logprobs: _baton_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_baton_pb2.TokenLogprob]
    samples: _containers.RepeatedCompositeFieldContainer[SampleFirst]
    def __init__(self, first_token_id: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_baton_pb2.FinishReason, str]] = ..., logprobs: _Optional[_Union[_baton_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_baton_pb2.TokenLogprob, _Mapping]]] = ..., samples: _Optional[_Iterable[_Union[SampleFirst, _Mapping]]] = ...) -> None: ...

class SampleFirst(_message.Message):
    __slots__ = ("first_token_id", "finished", "finish_reason", "logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finished: bool
    finish_reason: _baton_pb2.FinishReason
    logprobs: _baton_pb2.TokenLogprob
    def __init__(self, first_token_id: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_baton_pb2.FinishReason, str]] = ..., logprobs: _Optional[_Union[_baton_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "more_first_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    more_first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., more_first_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "cached_tokens", "snapshot_tokens", "logprobs", "draft_tokens", "accepted_tokens", "sample")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _baton_pb2.FinishReason
    cached_tokens: int
    snapshot_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_baton_pb2.TokenLogprob]
    draft_tokens: int
    accepted_tokens: int
    sample: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_baton_pb2.FinishReason, str]] = ..., cached_tokens: _Optional[int] = ..., snapshot_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_baton_pb2.TokenLogprob, _Mapping]]] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., sample: _Optional[int] = ...) -> None: ...

class ServeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "session_id", "max_uncached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_UNCACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _baton_pb2.SamplingParams
    session_id: str
    max_uncached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_baton_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., max_uncached_tokens: _Optional[int] = ...) -> None: ...

class PullSnapshotRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    source: Destination
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., source: _Optional[_Union[Destination, _Mapping]] = ...) -> None: ...

class PullSnapshotReply(_message.Message):
    __slots__ = ("blocks_pulled",)
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    blocks_pulled: int
    def __init__(self, blocks_pulled: _Optional[int] = ...) -> None: ...
