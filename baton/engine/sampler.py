"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Safe for every value `SamplingParams.validate` accepts: logits are shifted so that their
maximum is 0 before dividing by the temperature, so a tiny temperature (1e-38, even the
smallest subnormal) gives -inf or a large negative number, never +inf or NaN, and the
distribution collapses onto the argmax (greedy). A draw that still cannot be made (the
model produced non-finite logits) fails that request alone (`Draw.error`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from baton.engine.request import SamplingParams


class Draw(NamedTuple):
    """One request's sampled token, or why it could not be drawn."""

    token: int | None
    error: str | None = None


class Sampler:
    """Keeps one generator per seeded request so its tokens do not depend on its batch."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, ids: list[str], params: list[SamplingParams]) -> list[Draw]:
        """`logits` [B, vocab] float32 on any device; returns B draws, in order."""
        greedy = logits.argmax(dim=-1).tolist()
        out = []
        for i, p in enumerate(params):
            if p.greedy:
                out.append(Draw(greedy[i]))
                continue
            try:
                out.append(Draw(self._sample_one(logits[i].cpu(), ids[i], p)))
            except (ValueError, RuntimeError) as e:
                out.append(Draw(None, f"sampling failed: {e}"))
        return out

    def _sample_one(self, logits: torch.Tensor, rid: str, p: SamplingParams) -> int:
        logits = logits.double()
        if not bool(torch.isfinite(logits).all()):
            bad = int((~torch.isfinite(logits)).sum())
            raise ValueError(f"the model produced {bad} non-finite logits for request {rid}")
        # max -> exactly 0, the rest <= 0: dividing by any temperature > 0 cannot overflow
        logits = (logits - logits.max()) / p.temperature
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
