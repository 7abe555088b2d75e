"""`model.weight_dtype: float16 | bfloat16`: linear weights stored at half the bytes, float32
arithmetic. Not exact, so judged on its own terms: logits within a documented tolerance of
the float32 model, and greedy tokens equal wherever float32's top-1 leads by a clear margin."""

from __future__ import annotations

import pytest
import torch

from baton.model.layers.linear import cast_weights
from baton.model.loader import load_model
from tests.support.engine_helpers import engine_for, greedy, run_all

TPB = 16
# Largest |logit difference| to float32 (logits have std ~1.5 on the seeded models): bfloat16
# keeps 8 mantissa bits, float16 11. Measured on the tiny model: 2.6e-3 and 2.0e-2.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}
MARGIN = 0.05  # top-1 minus top-2 of float32 under which a token may flip (> 2x the bf16 error)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=[torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def half_model(request, model_tiny_dir):
    model = load_model(model_tiny_dir)
    full = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert cast_weights(model, request.param) == full // 2
    return request.param, model


def test_weights_take_half_the_bytes_and_activations_stay_float32(half_model):
    dtype, model = half_model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert {m.weight.dtype for m in linears} == {dtype}
    assert model.dtype == torch.float32
    assert model.backbone.embeddings.weight.dtype == torch.float32


def test_prefill_logits_within_tolerance(half_model, model_tiny):
    dtype, model = half_model
    ids = _ids(120, seed=3)
    ref = model_tiny.prefill(ids, 0, list(range(8)), 0, model_tiny.make_pools(8, TPB, 1),
                             all_logits=True)
    got = model.prefill(ids, 0, list(range(8)), 0, model.make_pools(8, TPB, 1), all_logits=True)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).abs().max().item() < TOLERANCE[dtype]


def _greedy(model, ids: torch.Tensor, steps: int) -> tuple[list[int], list[float]]:
    pools = model.make_pools(8, TPB, 1)
    table = list(range(8))
    logits = model.prefill(ids, 0, table, 0, pools)[None]
    toks, margins = [], []
    for i in range(steps):
        top = torch.topk(logits[0], 2)
        toks.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        logits = model.decode(torch.tensor(toks[-1:]), torch.tensor([len(ids) + i]), [table],
                              torch.tensor([0]), pools)
    return toks, margins


def test_greedy_equal_on_margin_filtered_prompts(half_model, model_tiny):
    dtype, model = half_model
    kept = 0
    for seed in range(16):
        ids = _ids(24 + 5 * seed, seed)
        ref, margins = _greedy(model_tiny, ids, 8)
        if min(margins) < MARGIN:
            continue  # a near tie: either token is a faithful answer
        kept += 1
        assert _greedy(model, ids, 8)[0] == ref, f"seed {seed}"
    assert kept >= 4, f"only {kept} of 16 prompts had every margin >= {MARGIN}"


def test_engine_config_stores_half_weights(model_tiny_dir, model_tiny):
    eng = engine_for(model_tiny_dir, model={"weight_dtype": "float16"})
    linears = [m for m in eng.model.modules() if isinstance(m, torch.nn.Linear)]
    assert {m.weight.dtype for m in linears} == {torch.float16}
    ids = _ids(30, seed=1)
    ref, margins = _greedy(model_tiny, ids, 8)
    assert min(margins) >= MARGIN
    from baton.engine.request import Request

    got = run_all(eng, [Request("a", ids.tolist(), greedy(8))])["tokens"]["a"]
    assert got == ref
