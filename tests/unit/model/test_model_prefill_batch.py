"""`prefill_batch`: several sequences' equally long chunks in one forward equal each alone."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("model_single_thread")

TPB = 16
T = 21


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _setup(model, prompts, starts, tables, slots):
    """Pools where each sequence's first `starts[i]` tokens are already prefilled."""
    pools = model.make_pools(24, TPB, 4)
    pools.conv.normal_()  # stale state in the slots of fresh sequences must be ignored
    pools.ssm.normal_()
    for p, s, t, slot in zip(prompts, starts, tables, slots, strict=True):
        if s:
            model.prefill(p[:s], 0, t, slot, pools)
    return pools


@pytest.mark.parametrize("starts", [[0, 0, 0], [0, 17, 40], [5, 5, 5]])
def test_batched_prefill_equals_each_sequence_alone(model_tiny, starts):
    prompts = [_ids(s + T, seed=i) for i, s in enumerate(starts)]
    tables = [[8 * i + j for j in range(8)][::-1] for i in range(3)]
    slots = [2, 0, 3]
    batch = _setup(model_tiny, prompts, starts, tables, slots)
    ids = torch.stack([p[s:] for p, s in zip(prompts, starts, strict=True)])
    together = model_tiny.prefill_batch(ids, starts, tables, slots, batch, all_logits=True)
    assert together.shape == (3, T, 512)
    for i, (p, s) in enumerate(zip(prompts, starts, strict=True)):
        alone = _setup(model_tiny, prompts, starts, tables, slots)
        single = model_tiny.prefill(p[s:], s, tables[i], slots[i], alone, all_logits=True)
        assert (together[i] - single).abs().max().item() < 1e-5
        assert torch.equal(together[i].argmax(-1), single.argmax(-1))
        assert torch.allclose(batch.kv[:, tables[i]], alone.kv[:, tables[i]], atol=1e-6)
        assert torch.allclose(batch.ssm[:, slots[i]], alone.ssm[:, slots[i]], atol=1e-6)
        assert torch.allclose(batch.conv[:, slots[i]], alone.conv[:, slots[i]], atol=1e-6)


def test_batched_prefill_returns_last_logits(model_tiny):
    ids = torch.stack([_ids(T, seed=7), _ids(T, seed=8)])
    tables, slots = [[0, 1], [2, 3]], [0, 1]
    pools = model_tiny.make_pools(4, TPB, 2)
    full = model_tiny.prefill_batch(ids, [0, 0], tables, slots, pools, all_logits=True)
    last = model_tiny.prefill_batch(ids, [0, 0], tables, slots, pools)
    assert last.shape == (2, 512) and last.dtype == torch.float32
    assert torch.allclose(last, full[:, -1], atol=1e-5)
