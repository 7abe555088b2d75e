"""Plain request/response values of the router-orchestrated flow (no protobuf past server.py).

Life of a request (router side):
  1. server.py turns GenerateRequest into a `GenerateInput`; orchestrator.py validates it.
  2. The policy (policies/) picks a prefill and a decode worker: `RouteChoice`.
  3. Decode worker Reserve -> `Reservation` (where prefill writes, held under a lease).
  4. Prefill worker Prefill(`PrefillInput` with the reservation) -> `PrefillResult`
     (returns once the KV/state transfer into the decode worker completed).
  5. Decode worker Decode -> `DecodeChunk`s; the router streams `GenerateChunk`s back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from baton.sampling import SamplingParams


class FinishReason(str, Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


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
class Reservation:
    """Where the prefill worker writes: the decode worker's leased blocks and slot."""

    worker_id: str
    transfer_endpoint: str
    block_ids: tuple[int, ...]
    slot: int | None
    """Live Mamba slot for the prompt-end state; None for a Mamba-free decode stage."""
    skip_blocks: int = 0
    """Leading prompt blocks the decode worker already holds."""
    lease_seconds: float = 0.0


@dataclass(frozen=True)
class ReserveInput:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    session_id: str = ""


@dataclass(frozen=True)
class PrefillInput:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    session_id: str
    destination: Reservation


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    cached_tokens: int = 0
    finished: bool = False
    """The first token already ends the request."""
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class DecodeChunk:
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    """Set on the last chunk only."""


@dataclass(frozen=True)
class GenerateSummary:
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    prefill_worker: str
    decode_worker: str
    ttft_ms: float
    latency_ms: float
    retries: int


@dataclass(frozen=True)
class GenerateChunk:
    """One message of the Generate stream; `summary` is set on the last one only."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str = ""
    summary: GenerateSummary | None = None
