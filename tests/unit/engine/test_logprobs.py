"""Logprobs and prompt logprobs from the engine equal a plain log-softmax of the model's logits
for the same tokens, whatever the chunking, and a prefix-cache hit does not change them."""

from __future__ import annotations

import pytest
import torch

from baton.engine.request import Request, SamplingParams
from baton.model.paged import Pools
from tests.support.engine_helpers import engine_for, make_checkpoint, prompt, run_all


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("logprobs"))


def _reference(model_dir, ids: list[int]) -> torch.Tensor:
    """log_softmax of the fp32 logits of every position of `ids`, one whole prefill."""
    eng = engine_for(model_dir, cache={"enable_prefix_reuse": False})
    model = eng.model
    pools = eng.pools
    n = (len(ids) + 15) // 16
    table = list(range(n))
    with torch.inference_mode():
        logits = model.prefill(torch.tensor(ids), 0, table, 0, pools, all_logits=True)
    assert isinstance(pools, Pools)
    return torch.log_softmax(logits.float(), dim=-1)


def _run(eng, rid: str, ids: list[int], **kw):
    s = SamplingParams(max_tokens=kw.pop("max_tokens", 4), ignore_eos=True, **kw)
    outs = []
    eng.add_request(Request(rid, list(ids), s))
    while True:
        got = [o for o in eng.step() if o.request_id == rid]
        outs.extend(got)
        if got and got[-1].finished:
            return outs


def test_generated_and_prompt_logprobs_equal_log_softmax(model_dir):
    ids = prompt(1, 37)
    eng = engine_for(model_dir, worker={"prefill_chunk_size": 16, "max_batch_tokens": 32})
    outs = _run(eng, "a", ids, logprobs=3, prompt_logprobs=2)
    gen = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in o.logprobs]
    ref = _reference(model_dir, ids + gen[:-1])
    assert [lp.token_id for lp in lps] == gen
    for k, lp in enumerate(lps):
        row = ref[len(ids) - 1 + k]
        assert abs(lp.logprob - float(row[gen[k]])) < 1e-4
        assert [t for t, _ in lp.top] == torch.topk(row, 3).indices.tolist()
    plp = outs[0].prompt_logprobs
    assert [p.token_id for p in plp] == ids[1:]  # token 0 has none
    for j, p in enumerate(plp):
        assert abs(p.logprob - float(ref[j][ids[j + 1]])) < 1e-4
        assert len(p.top) == 2 and p.top[0][0] == int(ref[j].argmax())
    assert all(o.prompt_logprobs == () for o in outs[1:])


def test_prompt_logprobs_with_a_prefix_hit_equal_a_cold_run(model_dir):
    """Bit for bit: the cold run is a fresh engine of the same config, so its chunks end at
    the same snapshot points (a scan split elsewhere rounds differently, ~1e-6)."""
    ids = prompt(2, 40)
    cache = {"mamba_state_config": {"periodic_snapshot_interval": 16}}
    cold = _run(engine_for(model_dir, cache=cache), "c", ids, prompt_logprobs=1, max_tokens=1)
    assert cold[0].cached_tokens == 0
    eng = engine_for(model_dir, cache=cache)
    warm_up = _run(eng, "w", ids + [5, 6], max_tokens=1)  # leaves snapshots of the prefix
    assert warm_up[-1].finished
    assert eng.cache.cached_prefix(ids) > 0  # a plain request would restore a prefix
    hit = _run(eng, "h", ids, prompt_logprobs=1, max_tokens=1)
    assert hit[0].cached_tokens == 0  # ...which a request scoring the prompt recomputes
    assert [(p.token_id, p.logprob, p.top) for p in hit[0].prompt_logprobs] == \
        [(p.token_id, p.logprob, p.top) for p in cold[0].prompt_logprobs]
    assert len(hit[0].prompt_logprobs) == 39


def test_requests_without_logprobs_carry_none(model_dir):
    eng = engine_for(model_dir)
    res = run_all(eng, [Request("p", prompt(3, 9), SamplingParams(max_tokens=3))])
    assert res["outputs"]["p"].logprobs == () and res["outputs"]["p"].prompt_logprobs == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logprobs_and_penalties_agree_with_cpu(model_dir):
    ids = prompt(4, 30)
    kw = dict(logprobs=2, prompt_logprobs=1, presence_penalty=0.5, repetition_penalty=1.2,
              logit_bias=((7, 1.5),), max_tokens=5)
    cpu = _run(engine_for(model_dir), "c", ids, **kw)
    gpu = _run(engine_for(model_dir, model={"device": "cuda"}), "g", ids, **kw)
    assert [o.new_token_ids for o in gpu] == [o.new_token_ids for o in cpu]
    for a, b in zip([lp for o in gpu for lp in o.logprobs],
                    [lp for o in cpu for lp in o.logprobs], strict=True):
        assert abs(a.logprob - b.logprob) < 1e-3
    assert [p.token_id for p in gpu[0].prompt_logprobs] == ids[1:]
