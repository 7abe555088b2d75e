"""A request's sampling parameters and its life inside one engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from baton.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self, vocab_size: int) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError(f"seed must be an integer >= 0, got {self.seed!r}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    session: str | None = None
    prefill_only: bool = False
    """Prefill worker: stop after the first token and keep the cache for the handoff."""
    output_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    num_computed: int = 0
    """Tokens whose KV and Mamba state are in the pools."""
    holds_cache: bool = False
    """Admitted: owns a live slot and blocks in the cache manager until finished or aborted."""
    cached_tokens: int = 0
    snapshot_points: tuple[int, ...] = ()
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def next_chunk_end(self, limit: int) -> int:
        """Where the next prefill chunk must end: a snapshot point, the prompt end or `limit`."""
        end = min(self.prompt_len, self.num_computed + limit)
        for p in self.snapshot_points:
            if self.num_computed < p < end:
                return p
        return end


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float | None = None
    latency_ms: float | None = None
    error: str | None = None
