"""Speculative sampling for temperature > 0 with one-hot drafts (the MTP head drafts greedily).

The target's token at every verified position is the sampler's own draw there, exactly as a
plain decode step would draw it: the distribution p of that row (temperature, top-k, top-p)
sampled with the generator of sequence position P (baton/engine/sampler.py). A draft d is
accepted exactly when it equals that token; at the first mismatch the drawn token is emitted
and the step stops; when every draft is accepted the next row's draw is the bonus token.

For a one-hot draft this is the exact rejection rule (accept d with probability p(d), else
emit x ~ p restricted to x != d): P(emit x) = p(x). And since the draws do not depend on
whether the step drafted, a seeded request gives the same tokens with speculation on or off,
drafting or not (the `speculative.max_batch` rule), at any batch around it (given the
target's logits do not depend on the batch, as the greedy identity tests check).
"""

from __future__ import annotations

import torch

from baton.engine.sampler import Sampler
from baton.sampling import SamplingParams


def accept_sampled(sampler: Sampler, rid: str, params: SamplingParams, logits: torch.Tensor,
                   drafts: list[int], first_pos: int) -> list[int]:
    """Tokens to emit for verify rows `logits` [m, vocab] (row j predicts the token at
    sequence position first_pos + j) and the m-1 `drafts`: the kept drafts, then the target's
    own draw at the first row whose draw differs from its draft (or at the last row); a
    ValueError if a row cannot be sampled (non-finite logits)."""
    out: list[int] = []
    for j in range(len(drafts) + 1):
        tok = sampler.draw(logits[j].cpu(), rid, params, first_pos + j)
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            return out
    return out
