"""Sampling parameters: one definition for the router, both workers and the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from baton.errors import InvalidRequestError

MAX_LOGPROBS = 20
"""Most alternatives `logprobs` / `prompt_logprobs` may ask for (OpenAI's limit)."""
MAX_SAMPLES = 16
"""Most samples (`n`) one request may ask for; a worker's cache may allow fewer."""


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
    logprobs: int | None = None
    """Report each generated token's logprob and the `logprobs` most likely (None: off)."""
    prompt_logprobs: int | None = None
    """Report every prompt token's logprob (the first has none) and the top N (None: off);
    the prompt is then computed whole, never restored from the prefix cache."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token the output already holds (OpenAI)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output holds it (OpenAI)."""
    repetition_penalty: float = 1.0
    """Logits of tokens in the prompt or output: divided by it if > 0, else multiplied
    (CTRL's rule, as vLLM and transformers apply it); 1 = off."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits."""
    min_tokens: int = 0
    """EOS and the stop tokens cannot be drawn before this many tokens were generated."""
    n: int = 1
    """Samples of the prompt: one prefill, then n decodes sharing the prompt's cache; sample
    i draws as a request of its own seeded `seed + i` would (`for_sample`)."""
    grammar: str = ""
    """llguidance grammar text the output follows (baton/agents/grammar.py); "" = none. Every
    worker that draws a token masks with its own matcher, rebuilt from this and the tokens
    drawn so far."""
    grammar_replay: int = 0
    """The prompt's last this many tokens were drawn under the grammar already (a request
    resumed on another pair after its decode worker died: prompt + tokens sent): the matcher
    replays them before the output's."""

    def for_sample(self, i: int) -> SamplingParams:
        """The parameters of sample `i` alone (n = 1; seeded seed + i, as n separate requests
        with consecutive seeds would be)."""
        seed = None if self.seed is None else (self.seed + i) % 2**63
        return replace(self, n=1, seed=seed)

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
        where = f"the vocabulary [0, {vocab_size})" if vocab_size else "[0, 2^31)"
        bad = [t for t in self.stop_token_ids if not 0 <= t < hi]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad} are outside {where}")
        bad = [t for t, _ in self.logit_bias if not 0 <= t < hi]
        if bad:
            raise InvalidRequestError(f"logit_bias keys {bad[:5]} are outside {where}")
        self._validate_extras()

    def _validate_extras(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or \
                not 1 <= self.n <= MAX_SAMPLES:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"{name} must be in [0, {MAX_LOGPROBS}], got {n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or not -2 <= v <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v!r}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got "
                f"{self.repetition_penalty!r}")
        bad = [b for _, b in self.logit_bias if not (math.isfinite(b) and -100 <= b <= 100)]
        if bad:
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bad[:5]}")
        if not isinstance(self.grammar_replay, int) or self.grammar_replay < 0 or \
                (self.grammar_replay and not self.grammar):
            raise InvalidRequestError(f"grammar_replay must be an integer >= 0 and needs a "
                                      f"grammar, got {self.grammar_replay!r}")
        if self.grammar and (self.ignore_eos or self.min_tokens):
            name = "ignore_eos" if self.ignore_eos else "min_tokens"
            raise InvalidRequestError(
                f"{name}: a constrained answer (response_format, tool_choice, structured "
                f"outputs) ends when its grammar does; leave {name} out")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                f"{self.min_tokens!r}")

    @property
    def penalized(self) -> bool:
        """Whether any logit processing applies before the draw (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.min_tokens or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
