"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from baton.engine.request import SamplingParams


class Sampler:
    """Keeps one generator per seeded request so its tokens do not depend on its batch."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, ids: list[str], params: list[SamplingParams]) -> list[int]:
        """`logits` [B, vocab] float32 on any device; returns B token ids."""
        out = logits.argmax(dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                out[i] = self._sample_one(logits[i].float().cpu(), ids[i], p)
        return out

    def _sample_one(self, logits: torch.Tensor, rid: str, p: SamplingParams) -> int:
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self._generator(rid, p)).item())

    def _generator(self, rid: str, p: SamplingParams) -> torch.Generator:
        g = self._generators.get(rid)
        if g is None:
            g = torch.Generator()
            if p.seed is not None:
                g.manual_seed(p.seed)
            else:
                g.seed()
            self._generators[rid] = g
        return g
