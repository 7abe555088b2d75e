"""Penalties, logit_bias and min_tokens against a plain-torch reference on the same logits, and
seeded draws that do not depend on the batch."""

from __future__ import annotations

import pytest
import torch

from baton.engine.penalties import apply
from baton.engine.sampler import Sampler
from baton.errors import InvalidRequestError
from baton.sampling import SamplingParams

V = 12
EOS = frozenset({2})


def reference(logits, p: SamplingParams, prompt, output, eos):
    """vLLM's order, written out element by element."""
    x = [float(v) for v in logits]
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = float("-inf")
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return torch.tensor(x)


CASES = [
    SamplingParams(presence_penalty=0.7),
    SamplingParams(frequency_penalty=-0.4),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, presence_penalty=-1.5, frequency_penalty=2.0),
    SamplingParams(logit_bias=((3, 5.0), (9, -100.0))),
    SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=(7,)),
    SamplingParams(max_tokens=8, min_tokens=4, ignore_eos=True, stop_token_ids=(7,)),
    SamplingParams(max_tokens=8, min_tokens=2, logit_bias=((2, 9.0),), repetition_penalty=1.2,
                   frequency_penalty=0.3),
]


@pytest.mark.parametrize("p", CASES)
def test_processing_equals_the_plain_reference(p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 3
    prompt, output = [1, 4, 4, 5], [5, 6, 6, 6]
    got = apply(logits, p, prompt, output, EOS)
    want = reference(logits, p, prompt, output, EOS)
    assert torch.allclose(got, want, atol=1e-6, equal_nan=False) or torch.equal(got, want)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(logits, logits.clone())  # the input is not changed


def test_greedy_follows_the_processed_logits_and_min_tokens_lifts():
    logits = torch.tensor([[0.0, 0.0, 5.0, 1.0, 0.5]])
    s = Sampler(EOS)
    p = SamplingParams(max_tokens=5, min_tokens=2)
    assert s.sample(logits, ["a"], [p], [3], [([1], [])]) == [(3, None)]  # EOS held back
    assert s.sample(logits, ["a"], [p], [4], [([1], [3])]) == [(3, None)]
    assert s.sample(logits, ["a"], [p], [5], [([1], [3, 3])]) == [(2, None)]  # 2 tokens: free
    biased = SamplingParams(logit_bias=((4, 10.0),))
    assert s.sample(logits, ["b"], [biased], [1], [([1], [])]) == [(4, None)]
    assert s.sample(logits, ["b"], [biased]) == [(2, None)]  # no contexts: nothing applies


def test_seeded_draws_repeat_and_ignore_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g)
    ps = [SamplingParams(temperature=1.0, seed=s, presence_penalty=0.5) for s in (7, 8, 9)]
    ctx = [([1, 2], [3]), ([1], []), ([4], [4, 4])]
    together = Sampler().sample(logits, ["a", "b", "c"], ps, [3, 1, 3], ctx)
    alone = [Sampler().sample(logits[i:i + 1], ["x"], [ps[i]], [[3, 1, 3][i]], [ctx[i]])[0]
             for i in range(3)]
    assert together == alone
    assert together == Sampler().sample(logits, ["a", "b", "c"], ps, [3, 1, 3], ctx)


@pytest.mark.parametrize("kw, message", [
    ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20], got -1"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"min_tokens": -1}, "min_tokens must be an integer in [0, max_tokens=16], got -1"),
    ({"logit_bias": ((600, 1.0),)}, "logit_bias keys [600] are outside the vocabulary [0, 512)"),
])
def test_bad_values_name_the_field_and_the_limit(kw, message):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw).validate(512)
    assert str(e.value).startswith(message)
