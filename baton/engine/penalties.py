"""Logit processing before the draw: logit_bias, min_tokens, then the repetition, frequency and
presence penalties, in vLLM's order, on the fp32 logits of one request.

Applied by whichever worker draws the token (the prefill worker's first token, the decode
worker's later ones, or the decode worker alone), from the request's own prompt and output, so
every path gives the same tokens. Greedy requests see them too: they change the argmax.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from baton.sampling import SamplingParams


def apply(logits: torch.Tensor, p: SamplingParams, prompt: Sequence[int],
          output: Sequence[int], eos_ids: frozenset[int]) -> torch.Tensor:
    """A processed copy of one request's logits [vocab]."""
    x = logits.float().clone()
    dev = x.device
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=dev)
        x.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=dev))
    if len(output) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
        if banned:
            x[torch.tensor(sorted(banned), device=dev)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=dev)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = Counter(output)
        ids = torch.tensor(list(counts), device=dev)
        n = torch.tensor(list(counts.values()), dtype=x.dtype, device=dev)
        x[ids] -= p.frequency_penalty * n + p.presence_penalty
    return x
