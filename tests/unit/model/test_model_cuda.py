"""The same model on CUDA agrees with CPU (skipped where no GPU is present)."""

from __future__ import annotations

import pytest
import torch

from baton.model.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(model, ids, split):
    pools = model.make_pools(8, 16, 2)
    table = [3, 0, 6, 1, 7, 2, 5, 4]
    a = model.prefill(ids[:split], 0, table, 1, pools, all_logits=True)
    b = model.prefill(ids[split:-4], split, table, 1, pools, all_logits=True)
    steps = []
    for p in range(len(ids) - 4, len(ids)):
        pos = torch.tensor([p])
        steps.append(model.decode(ids[p : p + 1], pos, [table], torch.tensor([1]), pools)[0])
    return torch.cat([a, b, torch.stack(steps)]).cpu()


def test_cuda_float32_matches_cpu(model_tiny_dir, model_tiny):
    ids = torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(0))
    ref = _run(model_tiny, ids, 37)
    got = _run(load_model(model_tiny_dir, device="cuda"), ids, 37)
    assert (got - ref).abs().max().item() < 1e-3


def test_cuda_bfloat16_tracks_float32(model_tiny_dir, model_tiny):
    ids = torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(1))
    ref = _run(model_tiny, ids, 50)
    got = _run(load_model(model_tiny_dir, device="cuda", dtype=torch.bfloat16), ids, 50)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.8
