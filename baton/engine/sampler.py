"""Turning logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Safe for every value `SamplingParams.validate` accepts: logits are shifted so that their
maximum is 0 before dividing by the temperature, so a tiny temperature (1e-38, even the
smallest subnormal) gives -inf or a large negative number, never +inf or NaN, and the
distribution collapses onto the argmax (greedy). A draw that still cannot be made (the
model produced non-finite logits) fails that request alone (`Draw.error`).

A seeded request's draw for the token at sequence position p (the number of tokens before
it, prompt included) depends only on (seed, p): a request moved to another worker, which
prefills prompt + the tokens so far, draws exactly what the first worker would have drawn,
and the prefill worker's first token and the decode worker's later ones agree with one
engine that ran the whole request.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from baton.engine import penalties
from baton.engine.request import SamplingParams
from baton.model.layers import step_kernels


class Draw(NamedTuple):
    """One request's sampled token, or why it could not be drawn."""

    token: int | None
    error: str | None = None


_MASK64 = (1 << 64) - 1


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first index of its maximum; a NaN's where there is one). On CPU
    float32 rows, where this process has the step kernels already, their `argmax_rows` (the
    index `max(dim)` gives: 52 vs 480 us for 32 x 16,384 logits at one thread, a third of a
    percent of a batch-32 decode step), else `max(dim)`, which gives the same index ~3x
    faster than torch's `argmax` there."""
    if logits.device.type == "cpu":
        k = step_kernels.loaded()  # the model's forward loaded it; never a build from here
        if k is not None and logits.dtype == torch.float32 and logits.dim() == 2 \
                and logits.shape[1] > 0 and logits.stride(1) == 1:
            return k.argmax_rows(logits)
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at sequence `position` (splitmix64 of
    both, so nearby seeds and positions give unrelated streams); < 2^63."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """Seeded draws depend only on (seed, position), never on the batch or on earlier draws;
    an unseeded request keeps one randomly seeded generator."""

    def __init__(self, eos_ids: frozenset[int] = frozenset()) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._seeded = torch.Generator()
        self.eos_ids = eos_ids
        """What `min_tokens` keeps from being drawn early (besides the stop tokens)."""

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @property
    def tracked(self) -> int:
        """Requests holding a generator of their own (unseeded sampling)."""
        return len(self._generators)

    def sample(self, logits: torch.Tensor, ids: list[str], params: list[SamplingParams],
               positions: list[int] | None = None,
               contexts: list[tuple[list[int], list[int]]] | None = None) -> list[Draw]:
        """`logits` [B, vocab] float32 on any device; `positions`: the sequence position of
        each token drawn (tokens before it; None: all 0); `contexts`: each request's (prompt,
        output so far), which penalties and min_tokens read (None: none apply); returns B
        draws, in order."""
        logits = self._processed(logits, params, contexts)
        greedy = greedy_ids(logits).tolist()
        out = []
        for i, p in enumerate(params):
            if p.greedy:
                out.append(Draw(greedy[i]))
                continue
            try:
                pos = 0 if positions is None else positions[i]
                out.append(Draw(self.draw(logits[i].cpu(), ids[i], p, pos)))
            except (ValueError, RuntimeError) as e:
                out.append(Draw(None, f"sampling failed: {e}"))
        return out

    def _processed(self, logits: torch.Tensor, params: list[SamplingParams],
                   contexts: list[tuple[list[int], list[int]]] | None) -> torch.Tensor:
        rows = [i for i, p in enumerate(params) if p.penalized] if contexts is not None else []
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            prompt, output = contexts[i]
            logits[i] = penalties.apply(logits[i], params[i], prompt, output, self.eos_ids)
        return logits

    def draw(self, logits: torch.Tensor, rid: str, p: SamplingParams, pos: int) -> int:
        """The non-greedy draw of one row of (processed) logits at sequence position `pos`;
        speculative verification draws each verified row with it too, so its tokens are
        exactly a plain step's."""
        probs = self.distribution(logits, rid, p)
        return int(torch.multinomial(probs, 1, generator=self.generator(rid, p, pos)).item())

    def distribution(self, logits: torch.Tensor, rid: str, p: SamplingParams) -> torch.Tensor:
        """The float64 distribution a non-greedy draw samples from (temperature, top-k,
        top-p applied); ValueError for non-finite logits."""
        logits = logits.double()
        if not bool((logits < float("inf")).all()) or bool(torch.isnan(logits).any()) or \
                not bool(torch.isfinite(logits).any()):
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
        return probs

    def generator(self, rid: str, p: SamplingParams, pos: int) -> torch.Generator:
        """The generator of the draw at sequence `pos`: seeded by (seed, pos) for a seeded
        request, else the request's own."""
        if p.seed is not None:
            return self._seeded.manual_seed(draw_seed(p.seed, pos))
        g = self._generators.get(rid)
        if g is None:
            g = torch.Generator()
            g.seed()
            self._generators[rid] = g
        return g
