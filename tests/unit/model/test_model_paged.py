"""The paged prefill/decode contract: resumed and chunked prefill, batched decode, pool layout."""

from __future__ import annotations

import pytest
import torch

from baton.errors import ConfigError, InvalidRequestError
from baton.model.loader import load_model
from baton.model.make_model import write_checkpoint

pytestmark = pytest.mark.usefixtures("model_single_thread")

TPB = 16
ATOL = 2e-5


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _one_shot(model, ids, table, pools, slot=0):
    return model.prefill(ids, 0, table, slot, pools, all_logits=True)


def _chunked(model, ids, cuts, table, pools, slot=0):
    outs, start = [], 0
    for end in [*cuts, len(ids)]:
        outs.append(model.prefill(ids[start:end], start, table, slot, pools, all_logits=True))
        start = end
    return torch.cat(outs)


@pytest.mark.parametrize("k", [1, 15, 16, 17, 32, 45, 99])
def test_resumed_prefill_equals_one_shot(model_tiny, k):
    ids = _ids(100)
    a = model_tiny.make_pools(8, TPB, 1)
    b = model_tiny.make_pools(8, TPB, 1)
    table = [5, 2, 7, 0, 3, 1, 6, 4]
    whole = _one_shot(model_tiny, ids, table, a)
    split = _chunked(model_tiny, ids, [k], table, b)
    assert (whole - split).abs().max().item() < ATOL
    # The pools end in the same state: same KV in the same blocks, same Mamba state.
    assert torch.allclose(a.kv, b.kv, atol=1e-5)
    assert torch.allclose(a.conv, b.conv, atol=1e-5)
    assert torch.allclose(a.ssm, b.ssm, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 7, 16, 50])
def test_chunked_prefill_equals_one_shot(model_tiny, chunk):
    ids = _ids(64 if chunk == 1 else 120, seed=3)
    table = list(range(8))
    whole = _one_shot(model_tiny, ids, table, model_tiny.make_pools(8, TPB, 1))
    cuts = list(range(chunk, len(ids), chunk))
    split = _chunked(model_tiny, ids, cuts, table, model_tiny.make_pools(8, TPB, 1))
    assert (whole - split).abs().max().item() < ATOL


def test_prefill_returns_last_logits_by_default(model_tiny):
    ids = _ids(20)
    pools = model_tiny.make_pools(2, TPB, 1)
    last = model_tiny.prefill(ids, 0, [0, 1], 0, pools)
    full = model_tiny.prefill(ids, 0, [0, 1], 0, pools, all_logits=True)
    assert last.shape == (512,) and last.dtype == torch.float32
    assert torch.allclose(last, full[-1], atol=1e-5)


def test_fresh_prefill_ignores_stale_slot_state(model_tiny):
    ids = _ids(30)
    clean = model_tiny.make_pools(2, TPB, 1)
    dirty = model_tiny.make_pools(2, TPB, 1)
    dirty.conv.normal_()
    dirty.ssm.normal_()
    dirty.kv.normal_()
    a = model_tiny.prefill(ids, 0, [0, 1], 0, clean)
    b = model_tiny.prefill(ids, 0, [0, 1], 0, dirty)
    assert torch.equal(a, b)


def test_decode_continues_prefill_exactly(model_tiny):
    ids = _ids(40, seed=5)
    table = [3, 1, 2]
    ref = _one_shot(model_tiny, ids, table, model_tiny.make_pools(4, TPB, 1))
    pools = model_tiny.make_pools(4, TPB, 1)
    model_tiny.prefill(ids[:33], 0, table, 0, pools)
    for p in range(33, 40):
        got = model_tiny.decode(
            ids[p : p + 1], torch.tensor([p]), [table], torch.tensor([0]), pools
        )
        assert (got[0] - ref[p]).abs().max().item() < 1e-4


def test_batched_decode_equals_each_sequence_alone(model_tiny):
    lengths = [1, 16, 17, 40, 5]
    prompts = [_ids(n, seed=n) for n in lengths]
    tables = [[4 * i + j for j in range(4)] for i in range(len(prompts))]
    slots = [4, 0, 3, 1, 2]
    batch = model_tiny.make_pools(20, TPB, 5)
    for p, t, s in zip(prompts, tables, slots, strict=True):
        model_tiny.prefill(p, 0, t, s, batch)
    toks = torch.tensor([7, 8, 9, 10, 11])
    pos = torch.tensor(lengths)
    together = model_tiny.decode(toks, pos, tables, torch.tensor(slots), batch)
    for i, (p, t) in enumerate(zip(prompts, tables, strict=True)):
        alone = model_tiny.make_pools(20, TPB, 5)
        model_tiny.prefill(p, 0, t, slots[i], alone)
        one = slice(i, i + 1)
        single = model_tiny.decode(toks[one], pos[one], [t], torch.tensor(slots[one]), alone)
        assert (together[i] - single[0]).abs().max().item() < 1e-5
        for blk in t:
            assert torch.allclose(batch.kv[:, blk], alone.kv[:, blk], atol=1e-6)
        assert torch.allclose(batch.ssm[:, slots[i]], alone.ssm[:, slots[i]], atol=1e-6)
        assert torch.allclose(batch.conv[:, slots[i]], alone.conv[:, slots[i]], atol=1e-6)


def test_kv_lands_at_block_table_positions(model_tiny):
    pools = model_tiny.make_pools(6, 4, 1)
    model_tiny.prefill(_ids(6), 0, [5, 2], 0, pools)
    used = pools.kv.abs().sum(dim=(0, 2, 4, 5))  # [block, token]
    assert used[5].gt(0).all() and used[2, :2].gt(0).all()
    assert used[2, 2:].eq(0).all()
    assert used[[0, 1, 3, 4]].eq(0).all()


def test_short_block_table_is_rejected(model_tiny):
    pools = model_tiny.make_pools(4, TPB, 1)
    with pytest.raises(InvalidRequestError, match="need 2 blocks"):
        model_tiny.prefill(_ids(17), 0, [0], 0, pools)


def test_pools_missing_a_layer_are_rejected(model_tiny):
    from baton.model.pools import Pools, PoolSpec

    spec = PoolSpec.for_model(
        model_tiny.config, num_blocks=2, tokens_per_block=TPB, num_slots=1, layers=range(3)
    )
    with pytest.raises(ConfigError, match=r"also needs layers \[4, 5, 6\]"):
        model_tiny.prefill(_ids(4), 0, [0], 0, Pools(spec))
    with pytest.raises(ConfigError, match="PoolSpec.for_model"):
        model_tiny.decode(_ids(1), torch.tensor([0]), [[0]], torch.tensor([0]), Pools(spec))


@pytest.mark.parametrize("pattern", ["M-M", "*-*"])
def test_single_cache_kind_models(tmp_path, pattern):
    """Attention-free and Mamba-free models run with one of the two pools empty."""
    model = load_model(write_checkpoint(tmp_path, pattern=pattern, seed=1))
    ids = _ids(50, seed=2)
    whole = _one_shot(model, ids, [0, 1, 2, 3], model.make_pools(4, TPB, 1))
    pools = model.make_pools(4, TPB, 1)
    model.prefill(ids[:49], 0, [0, 1, 2, 3], 0, pools)
    got = model.decode(ids[49:], torch.tensor([49]), [[0, 1, 2, 3]], torch.tensor([0]), pools)
    assert (got[0] - whole[-1]).abs().max().item() < 1e-4
