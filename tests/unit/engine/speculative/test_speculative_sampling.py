"""Speculative sampling keeps the target's distribution: the rejection rule over many seeds
(chi-square against the exact distribution), on its own and through the engine."""

from __future__ import annotations

import pytest
import torch

from baton.engine.request import Request, SamplingParams
from baton.engine.sampler import Sampler
from baton.engine.speculative.rejection import accept_sampled
from tests.support.engine_helpers import engine_for, run_all
from tests.support.speculative_helpers import agreeing_checkpoint

pytestmark = pytest.mark.usefixtures("model_single_thread")


def _chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test; cells expecting fewer than 5 are pooled into one."""
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


@pytest.mark.parametrize("draft_rank", [0, 3])  # a likely draft (mostly kept), an unlikely one
def test_rejection_rule_keeps_the_distribution(draft_rank):
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(3, 12, generator=gen) * 1.5
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(6000)]
    sampler = Sampler()
    p0 = sampler.distribution(logits[0], "x", params[0])
    d1 = int(torch.argsort(p0, descending=True)[draft_rank])
    first = torch.zeros(12, dtype=torch.float64)
    kept = 0
    for p in params:
        out = accept_sampled(sampler, "x", p, logits, [d1, 5], first_pos=40)
        first[out[0]] += 1
        kept += out[0] == d1 and len(out) > 1
    assert _chi2_pvalue(first, p0 * len(params)) > 1e-3
    assert abs(kept / len(params) - float(p0[d1])) < 0.03  # acceptance = p(draft)
    # the same seed draws the same tokens
    assert accept_sampled(sampler, "x", params[7], logits, [d1, 5], 40) == \
        accept_sampled(sampler, "x", params[7], logits, [d1, 5], 40)


def test_engine_sampling_distribution_unchanged_by_speculation(tmp_path):
    """400 seeds of one prompt at K=1: the second token (drafted, then kept or resampled) is
    distributed as the target says given the first."""
    ck = agreeing_checkpoint(tmp_path)
    eng = engine_for(ck, worker={"max_num_seqs": 16}, speculative={"num_draft_tokens": 1})
    prompt = [17, 230, 41, 9]
    params = dict(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    reqs = [Request(f"s{i}", prompt, SamplingParams(seed=i, **params)) for i in range(400)]
    toks = run_all(eng, reqs)["tokens"]
    assert eng.spec.accepted_tokens > 50 and eng.spec.draft_tokens - eng.spec.accepted_tokens > 50
    model, sampler = eng.model, Sampler()
    by_first: dict[int, list[int]] = {}
    for t in toks.values():
        by_first.setdefault(t[0], []).append(t[1])
    tested = 0
    for t0, seconds in by_first.items():
        if len(seconds) < 40:
            continue
        pools = model.make_pools(4, 16, 1)
        logits = model.prefill(torch.tensor([*prompt, t0]), 0, [0, 1, 2, 3], 0, pools)
        p = sampler.distribution(logits, "x", SamplingParams(seed=0, **params))
        counts = torch.bincount(torch.tensor(seconds), minlength=p.numel()).double()
        support = p > 0
        assert counts[~support].sum() == 0
        assert _chi2_pvalue(counts[support], p[support] * len(seconds)) > 1e-3
        tested += 1
    assert tested >= 2
