"""The colocated engine on CUDA, for every family (skipped where no GPU is present): batched
and chunked prefills, prefix hits and MTP speculation in the same steps. Each greedy token it
emits is CPU float32's top-1 over the same tokens, up to a near-tie (the two devices sum in
different orders, so a tie can break either way; after it both are followed on CUDA's path)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from baton.engine.request import Request
from baton.model.loader import load_model
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, run_all
from tests.support.speculative_helpers import agreeing_checkpoint, agreeing_qwen_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEAR_TIE = 2e-3
"""How far below CPU's top-1 logit a CUDA greedy token may be (CUDA's logits are within 1e-3
of CPU's: test_model_cuda)."""

FAMILIES = {
    "nemotron_h": lambda root: agreeing_checkpoint(root),
    "nemotron_h_moe": lambda root: agreeing_checkpoint(root, pattern="M*MEM*ME"),
    "qwen3_5": agreeing_qwen_checkpoint,
    "qwen3_5_moe": lambda root: make_checkpoint(root, "qmoe", family="qwen3_5_moe", seed=4),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    return request.param, FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


def _workload() -> list[Request]:
    """12 greedy requests of 1..700 prompt tokens at concurrency 8 (chunks of 128), the last
    four extending earlier prompts (prefix hits where the earlier one has finished)."""
    rng = random.Random(3)
    reqs: list[Request] = []
    for i, n in enumerate([1, 5, 31, 100, 300, 700] * 2):
        ids = [rng.randrange(3, 512) for _ in range(n)]
        if i >= 8:
            ids = reqs[i - 6].prompt_ids + ids[:20]
        reqs.append(Request(f"r{i:02d}", ids, greedy(12)))
    return reqs


def _run_cuda(model_dir, spec_k: int):
    eng = engine_for(model_dir, model={"device": "cuda"},
                     worker={"max_num_seqs": 8, "prefill_chunk_size": 128},
                     speculative={"num_draft_tokens": spec_k})
    return eng, run_all(eng, _workload())


def _assert_cpu_top1(model_dir, reqs: list[Request], tokens: dict[str, list[int]]) -> None:
    """Every emitted token is within NEAR_TIE of CPU float32's best logit at its position,
    teacher-forced over the tokens CUDA emitted."""
    cpu = load_model(model_dir)
    worst = 0.0
    for r in reqs:
        out = tokens[r.id]
        assert len(out) == 12, r.id
        ids = torch.tensor(r.prompt_ids + out[:-1])
        blocks = math.ceil(len(ids) / 16) + 1
        pools = cpu.make_pools(blocks, 16, 2)
        logits = cpu.prefill(ids, 0, list(range(blocks)), 1, pools, all_logits=True)
        rows = logits[len(r.prompt_ids) - 1:]
        gap = rows.max(-1).values - rows.gather(1, torch.tensor(out)[:, None])[:, 0]
        worst = max(worst, gap.max().item())
    assert worst <= NEAR_TIE, worst


def test_cuda_engine_greedy_tokens_are_cpu_top1(family_dir):
    _, model_dir = family_dir
    eng, out = _run_cuda(model_dir, 0)
    assert eng.model.device.type == "cuda"
    assert sum(o.cached_tokens > 0 for o in out["outputs"].values()) >= 2
    _assert_cpu_top1(model_dir, _workload(), out["tokens"])
    eng.cache.check_integrity()


def test_cuda_engine_speculating_is_cpu_top1(family_dir):
    name, model_dir = family_dir
    if name == "qwen3_5_moe":
        pytest.skip("this checkpoint has no MTP head")
    eng, out = _run_cuda(model_dir, 3)
    assert eng.spec.accepted_tokens > 0
    assert eng.spec.draft_tokens > eng.spec.accepted_tokens
    _assert_cpu_top1(model_dir, _workload(), out["tokens"])
    assert eng.tracked()["spec_pending"] == 0
    eng.cache.check_integrity()
