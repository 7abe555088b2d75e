"""Speculative sampling for temperature > 0 with one-hot drafts (the MTP head drafts greedily).

For the draft d at sequence position P (tokens before it) with target distribution p (the
sampler's: temperature, top-k, top-p):

    u ~ U[0, 1)                      accept d when u < p(d)
    rejected: x ~ p with d removed, renormalised; emit x and stop
    every draft accepted: the bonus token is the sampler's own draw at its position

P(emit x) = p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x): the distribution is
the target's. Every draw at position P uses the sampler's generator for P, so a seeded
request's draws depend only on (seed, P) (baton/engine/sampler.py), as without speculation.
"""

from __future__ import annotations

import torch

from baton.engine.sampler import Sampler
from baton.sampling import SamplingParams


def accept_sampled(sampler: Sampler, rid: str, params: SamplingParams, logits: torch.Tensor,
                   drafts: list[int], first_pos: int) -> list[int]:
    """Tokens to emit for verify rows `logits` [m, vocab] (row j predicts the token at
    sequence position first_pos + j) and the m-1 `drafts`; ValueError if a row cannot be
    sampled (non-finite logits)."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        probs = sampler.distribution(logits[j].cpu(), rid, params)
        g = sampler.generator(rid, params, first_pos + j)
        u = float(torch.rand((), dtype=torch.float64, generator=g))
        if u < float(probs[d]):
            out.append(d)
            continue
        rest = probs.clone()
        rest[d] = 0.0
        out.append(int(torch.multinomial(rest / rest.sum(), 1, generator=g).item()))
        return out
    last = len(drafts)
    probs = sampler.distribution(logits[last].cpu(), rid, params)
    g = sampler.generator(rid, params, first_pos + last)
    out.append(int(torch.multinomial(probs, 1, generator=g).item()))
    return out
