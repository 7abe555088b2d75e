"""A request's sampling parameters and its life inside one engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from baton.contract import FinishReason, TokenLogprob
from baton.sampling import SamplingParams

__all__ = ["Phase", "Request", "RequestOutput", "SamplingParams", "sample_id"]


def sample_id(request_id: str, sample: int) -> str:
    """The engine's id of sample `sample` of a request with n > 1 (sample 0 is the request)."""
    return request_id if sample == 0 else f"{request_id}#{sample}"


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
    round_points: tuple[int, ...] = ()
    """Where its live state is rounded to the stored state dtype (chunks end there too; set
    with reuse off as well; baton/engine/state_rounding.py)."""
    rounded_at: int = -1
    """The last of them its live state was rounded at (-1: none yet)."""
    finish_reason: FinishReason | None = None
    end_snapshot_tokens: int = 0
    """Tokens (prompt + answer) of the decode-end snapshot it left on finishing (0: none)."""
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """Prompt tokens scored so far, chunk by chunk (when `sampling.prompt_logprobs` is set)."""
    draft_tokens: int = 0
    """MTP drafts verified for it so far (speculative decoding; 0 when it does not speculate)."""
    accepted_tokens: int = 0
    """Of those, the drafts the target accepted."""
    arrival: float = field(default_factory=time.monotonic)
    prefill_start_time: float | None = None
    """When its first prompt chunk's forward began (time.monotonic; the request's phases)."""
    forward_done_time: float | None = None
    """When the forward of its prompt's last chunk ended, before its first token was drawn."""
    first_token_time: float | None = None
    finish_time: float | None = None
    family: str | None = None
    """Samples 1.. of a request with n > 1: that request's id (its outputs carry it)."""
    sample: int = 0
    """Which of its request's samples this is (0: the request itself)."""

    @property
    def forks(self) -> int:
        """Samples it will hold a cache for (a prefill-only request hands one over)."""
        return 1 if self.prefill_only else self.sampling.n

    @property
    def key(self) -> str:
        """The id its outputs carry: the request's, for every one of its samples."""
        return self.family or self.id

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def next_chunk_end(self, limit: int) -> int:
        """Where the next prefill chunk must end: a snapshot point, the prompt end or `limit`."""
        end = min(self.prompt_len, self.num_computed + limit)
        for p in sorted((*self.snapshot_points, *self.round_points)):
            if self.num_computed < p < end:
                return p
        return end


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float | None = None
    latency_ms: float | None = None
    error: str | None = None
    snapshot_tokens: int = 0
    """Last output only: the prompt + answer tokens its decode-end snapshot covers (0: none
    taken), so that the router knows of it before the next turn arrives."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per new token when the request asked for logprobs (the decode worker's first token,
    drawn by the prefill worker, has none here)."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """The output of the prompt's last chunk only, when the request asked for them."""
    draft_tokens: int = 0
    """Speculative decoding: drafts verified for the request so far, and of those..."""
    accepted_tokens: int = 0
    """...the ones accepted (totals up to this output)."""
    sample: int = 0
    """Which sample of the request (n > 1) the output is of."""
    open_samples: int = 0
    """Finished outputs: samples of the request still running after this one (0: the
    request is over; always 0 when n = 1)."""
