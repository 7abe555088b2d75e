"""Sampling parameters: one definition for the router, both workers and the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass

from baton.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    """Most tokens generated, the first one included."""
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens, whatever the batch."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these tokens (the token is returned)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""

    def validate(self, vocab_size: int | None = None) -> None:
        """InvalidRequestError naming the field, its value and the allowed range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError(f"seed must be an integer >= 0, got {self.seed!r}")
        hi = vocab_size if vocab_size is not None else 2**31
        bad = [t for t in self.stop_token_ids if not 0 <= t < hi]
        if bad:
            where = f"the vocabulary [0, {vocab_size})" if vocab_size else "[0, 2^31)"
            raise InvalidRequestError(f"stop_token_ids {bad} are outside {where}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
