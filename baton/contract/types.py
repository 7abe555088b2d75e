"""Everything that crosses a process boundary, as plain frozen dataclasses and enums.

One definition per concept, shared by the router, both worker roles, the client and the test
fakes; `baton/contract/wire.py` is the only place that turns them into protobuf and back.

Life of a request, in contract types:
  client   GenerateInput ───────────────► router
  router   ReserveInput ────────────────► decode worker ──► Reservation
  router   PrefillInput(destination=Reservation) ► prefill worker ──► PrefillResult
  router   request id + first token ────► decode worker ──► DecodeChunk ... (finish_reason)
  or, conditional disaggregation (the decode worker holds the prompt's deepest snapshot):
  router   ServeInput ──────────────────► decode worker ──► DecodeChunk ... (first: cached_tokens)
  decode-end state shipped back, in the background after a turn:
  router   ReserveInput ────────────────► decode worker (HoldSnapshot) ──► Reservation (source)
  router   SnapshotShipment ────────────► prefill worker (PullSnapshot) ──► NIXL READ, commit
  router   GenerateChunk ... (summary on the last one) ──► client
  workers  WorkerInfo / WorkerLoad / SnapshotEvent ──► router (Register, Heartbeat)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from baton.sampling import SamplingParams

DEFAULT_LEASE_SECONDS = 30.0
"""How long a decode reservation is held for its transfer (`transfer.lease_seconds`)."""
DEFAULT_TOKENS_PER_BLOCK = 16
"""Tokens per paged KV block (`cache.tokens_per_block`)."""
ENDED_AT_FIRST_TOKEN = "the first token ended the request"
"""The prefill worker's transfer-abort reason when its first token finished the request
(max_tokens 1, as lm-eval's loglikelihood requests are; EOS): the decode side owed nothing."""


class FinishReason(str, Enum):
    """Why a request stopped; a `str` so that `FinishReason.STOP == "stop"`."""

    LENGTH = "length"
    """max_tokens reached."""
    STOP = "stop"
    """EOS or a stop token was generated, or the client ended the answer (an HTTP stop
    string: the request is cancelled on the workers, its summary still reported)."""
    ABORT = "abort"
    """Cancelled by the client or aborted on the worker."""
    ERROR = "error"
    """The engine failed the request (a worker turns this into an error status, not a chunk)."""


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability: the log-softmax of the model's fp32 logits at its position,
    before any sampling parameter (temperature, penalties, bias), and the most likely tokens
    there, best first (as many as the request's `logprobs` / `prompt_logprobs` asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerateInput:
    request_id: str
    prompt_ids: tuple[int, ...] | None = None
    """Token ids; exactly one of prompt_ids / prompt_text is set."""
    prompt_text: str | None = None
    """Text, tokenized by the router's tokenizer."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str = ""


@dataclass(frozen=True)
class ReserveInput:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str = ""


@dataclass(frozen=True)
class Reservation:
    """Where the prefill worker writes: the decode worker's leased blocks and slot."""

    worker_id: str
    transfer_endpoint: str
    block_ids: tuple[int, ...]
    """The prompt's whole block table; prefill writes all but the first `skip_blocks`."""
    slot: int | None
    """Live Mamba slot for the prompt-end state; None for a Mamba-free decode stage."""
    skip_blocks: int = 0
    """Leading prompt blocks the decode worker already holds."""
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    incarnation: str = ""
    """Random id of the decode worker's transfer endpoint process (a restart changes it)."""
    signature: bytes = b""
    """The decode worker's HMAC over the request id and every field above; the prefill worker
    writes nothing unless it verifies (baton/auth/reservations.py). Empty without a secret."""

    @property
    def endpoints(self) -> list[str]:
        """Every decode stage's side channel: a pipeline-parallel decode worker lists its
        stages' endpoints in `transfer_endpoint`, comma-separated, in stage order (one
        signature covers them all)."""
        return [e for e in self.transfer_endpoint.split(",") if e]


@dataclass(frozen=True)
class PrefillInput:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    session_id: str
    destination: Reservation | None = None
    """None while the router is still reserving it (it follows on the same Prefill stream)."""


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    cached_tokens: int = 0
    finished: bool = False
    """The first token already ends the request; then nothing was transferred."""
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprob | None = None
    """The first token's logprob (None unless the request asked for logprobs)."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """Prompt tokens 1.. (token 0 has none), when the request asked for prompt_logprobs."""
    samples: tuple[PrefillResult, ...] = ()
    """n > 1: the first tokens of samples 1.. (this result is sample 0's), drawn from the
    same logits; their cached_tokens and prompt_logprobs are left unset (shared)."""
    phases_ms: dict[str, float] = field(default_factory=dict, compare=False)
    """Where the prefill worker's time went, by phase (baton/worker/phases.py); a debug
    field, carried in the call's trailing metadata."""

    @property
    def firsts(self) -> tuple[PrefillResult, ...]:
        """Every sample's first token, sample 0 first."""
        return (self, *self.samples)


@dataclass(frozen=True)
class ServeInput:
    """A request run on one decode worker alone: it restores its own deepest snapshot of the
    prompt and prefills the rest itself, unless that is more than `max_uncached_tokens`."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    session_id: str = ""
    max_uncached_tokens: int = 0


@dataclass(frozen=True)
class SnapshotShipment:
    """A decode worker's held snapshot of exactly `token_ids` (a whole finished turn), for a
    prefill worker to pull (the decode-end state shipped back); `source` is the decode
    worker's signed HoldSnapshot reply: where the blocks and the state slot lie."""

    request_id: str
    token_ids: tuple[int, ...]
    source: Reservation


@dataclass(frozen=True)
class DecodeChunk:
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    """Set on the last chunk only."""
    cached_tokens: int = 0
    """Serve only, on the first chunk: prompt tokens the worker restored from a snapshot."""
    snapshot_tokens: int = 0
    """Last chunk only: the decode-end snapshot the worker now holds covers this many tokens
    of prompt + output (0: none taken)."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token of `token_ids` when the request asked for logprobs, else empty."""
    draft_tokens: int = 0
    """Last chunk only: speculative decoding's drafts verified for the request..."""
    accepted_tokens: int = 0
    """...and of those the accepted ones (0 without speculation)."""
    sample: int = 0
    """The sample (n > 1) the chunk is of; `finish_reason` ends that sample only."""


@dataclass(frozen=True)
class GenerateSummary:
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the worker that computed the prompt skipped (prefill or decode worker)."""
    prefill_worker: str
    """Empty when the request ran on its decode worker alone (conditional disaggregation)."""
    decode_worker: str
    ttft_ms: float
    latency_ms: float
    retries: int
    draft_tokens: int = 0
    """Speculative decoding on the decode worker: drafts verified, and accepted."""
    accepted_tokens: int = 0
    phases_ms: dict[str, float] = field(default_factory=dict, compare=False)
    """Where the time to first token went, by phase (baton/worker/phases.py; empty when not
    measured); carried in the Generate stream's trailing metadata."""


@dataclass(frozen=True)
class GenerateChunk:
    """One message of the Generate stream; `summary` is set on the last one only."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str = ""
    summary: GenerateSummary | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token of `token_ids` when the request asked for logprobs, else empty."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """First chunk only, when asked: prompt tokens 1.. (token 0 has none)."""
    sample: int = 0
    """The sample (n > 1) the chunk is of: each sample ends with its own summary."""


@dataclass(frozen=True)
class WorkerLoad:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    free_slots: int = 0
    total_blocks: int = 0
    total_slots: int = 0


@dataclass(frozen=True)
class StageInfo:
    """One pipeline stage of a worker: global layers first_layer.. (num_layers of them) and
    its transfer side channel (decode workers; "" on prefill workers)."""

    first_layer: int
    num_layers: int
    transfer_endpoint: str = ""


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker registers with."""

    worker_id: str
    role: Role
    address: str
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    load: WorkerLoad = WorkerLoad()
    max_model_len: int = 0
    """Longest prompt + output the worker accepts (0 = not reported)."""
    stages: tuple[StageInfo, ...] = ()
    """Every pipeline stage, in order (empty: not reported)."""


@dataclass(frozen=True)
class SnapshotEvent:
    """A snapshot inserted into or evicted from a worker; keys from contract/prefix_hash.py."""

    inserted: bool
    block_hash: int
    snapshot_hash: int
    num_tokens: int
    tier: int = 0
    """0: in the worker's pool; 1: in its disk tier (restored before use, cheaper than
    computing, dearer than a pool hit)."""


@dataclass(frozen=True)
class WorkerView:
    """A worker as the router sees it (routing decisions, ListWorkers)."""

    worker_id: str
    role: Role
    address: str
    tokens_per_block: int
    load: WorkerLoad
    inflight: int
    """Requests this router has in flight on the worker."""
    seconds_since_heartbeat: float = 0.0
    tracked_snapshots: int = 0
    """Snapshots of this worker the router's policy indexes (ListWorkers only)."""
    max_model_len: int = 0
    """Longest prompt + output the worker accepts (0 = not reported)."""

    @property
    def busy(self) -> int:
        """Requests the worker has, counting routed ones its heartbeat has not shown yet."""
        return max(self.load.running + self.load.waiting, self.inflight)

    def load_key(self) -> tuple[int, int, str]:
        """Sort key, least loaded first: busy, then more free blocks, then id (stable ties)."""
        return (self.busy, -self.load.free_blocks, self.worker_id)
