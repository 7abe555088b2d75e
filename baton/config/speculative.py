"""`speculative`: MTP speculative decoding (drafts from the checkpoint's MTP head, verified by
the target in one forward; see baton/engine/speculative/)."""

from __future__ import annotations

from dataclasses import dataclass

from baton.errors import ConfigError

MAX_DRAFT_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    num_draft_tokens: int = 0
    """Draft tokens per decode step (`--speculative-tokens`): 0 = off (the default), 1..8.
    Needs a checkpoint with an MTP head (`num_nextn_predict_layers` > 0 and `mtp.*`
    tensors). Each step drafts K tokens with the MTP head applied K times, the target
    verifies K+1 positions in one forward and greedy acceptance emits the accepted drafts
    plus one target token: greedy output is identical to speculation off. Temperature > 0
    uses the rejection rule for one-hot drafts (the target's distribution is kept; a seeded
    request's draws depend only on (seed, position)). A prefill-only handoff does not draft."""

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT_TOKENS:
            raise ConfigError(
                f"speculative.num_draft_tokens must be an integer in 0..{MAX_DRAFT_TOKENS} "
                f"(0 = off), got {k!r}"
            )
