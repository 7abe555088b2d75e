"""Rounding float32 state to bfloat16 / float16: the distribution of stochastic rounding, its
position keying (the same bytes from any slot, batch layout or thread count), exact values,
and nearest = torch's own conversion."""

from __future__ import annotations

import pytest
import torch

from baton.cache.rounding import (
    _bf16_stochastic,
    _neighbours_stochastic,
    draws,
    round_state,
    round_stochastic,
    stream_key,
)

CHI2_999 = {1: 10.828, 6: 22.458, 255: 330.52}
"""Chi-square critical values at p = 0.001 by degrees of freedom."""
DTYPES = (torch.bfloat16, torch.float16)
MANT = {torch.bfloat16: 7, torch.float16: 10}


def keys_for(positions, seed=7, prefix=0x1234, layer=3, tensor="ssm"):
    return torch.tensor([stream_key(seed, prefix, p, layer, tensor) for p in positions])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_stream_key_and_draws_are_pinned():
    """Workers on other hosts and versions must draw the same bits: the values are fixed."""
    k = stream_key(7, 0x1234, 64, 3, "ssm")
    assert k == -7449627230637488329
    assert draws(torch.tensor([k]), (6,)).tolist() == [
        [3531025, 15687743, 8782433, 6717189, 15456972, 9885892]]


def test_draws_are_uniform():
    d = draws(keys_for(range(4)), (16384,)).flatten()
    assert int(d.min()) >= 0 and int(d.max()) < 2**24
    counts = torch.bincount(d >> 16, minlength=256).double()
    expect = d.numel() / 256
    assert float(((counts - expect) ** 2 / expect).sum()) < CHI2_999[255]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sign", (1.0, -1.0))
def test_round_up_probability_is_the_fractional_part(dtype, sign):
    """For x = (1 + (j + f) ulp) the share stored as the upper neighbour is f: chi-square over
    six fractions (p = 0.001, fixed keys so the test is deterministic)."""
    ulp = 2.0 ** -MANT[dtype]
    fracs = (1 / 16, 1 / 8, 0.25, 0.5, 0.75, 0.9375)
    n = 4000
    stat = 0.0
    for i, f in enumerate(fracs):
        x = torch.full((1, n), sign * (1 + (3 + f) * ulp))
        y = round_stochastic(x, dtype, keys_for([100 + i])).float()
        lo, hi = sign * (1 + 3 * ulp), sign * (1 + 4 * ulp)
        assert set(y.flatten().tolist()) <= {lo, hi}
        ups = float((y == hi).sum())
        for observed, expected in ((ups, n * f), (n - ups, n * (1 - f))):
            stat += (observed - expected) ** 2 / expected
    assert stat < CHI2_999[6], stat


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_rounding_is_unbiased(dtype):
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(0)) * 3
    mean = torch.stack([round_stochastic(x, dtype, keys_for([p])).float()
                        for p in range(400)]).mean(0)
    ulp = x.abs() * 2.0 ** -MANT[dtype]
    assert float(((mean - x).abs() / ulp).max()) < 0.1  # nearest is off by up to 0.5 ulp


@pytest.mark.parametrize("dtype", DTYPES)
def test_representable_values_are_stored_exactly(dtype):
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    every = every[torch.isfinite(every.float())]
    x = every.float().reshape(1, -1)
    y = round_stochastic(x, dtype, keys_for([5]))
    assert torch.equal(bits(y), bits(x.to(dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nearest_is_torch_conversion(dtype):
    x = torch.randn(3, 999, generator=torch.Generator().manual_seed(1)) * 100
    assert torch.equal(bits(round_state(x, dtype, "nearest")), bits(x.to(dtype)))


def test_special_values():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[inf, -inf, nan, 3.4e38, -3.4e38, 7e4, 0.0, -0.0]])
    y16 = round_stochastic(x, torch.float16, keys_for([1])).float()
    assert y16[0, :2].tolist() == [inf, -inf] and torch.isnan(y16[0, 2])
    assert y16[0, 3:].tolist() == [65504.0, -65504.0, 65504.0, 0.0, 0.0]  # finite saturates
    assert bits(round_stochastic(x, torch.float16, keys_for([1])))[0, 7] == bits(
        torch.tensor(-0.0, dtype=torch.float16))


def test_same_bytes_from_any_slot_batch_layout_or_thread_count():
    """A state's stored bytes depend on (key, element) only: a row rounded alone, inside a
    batch of five at row 3, written into pool slot 1 or 6, with 1 or 2 threads, is equal."""
    g = torch.Generator().manual_seed(2)
    state = torch.randn(1, 8, 16, 32, generator=g)
    key = keys_for([64])
    alone = round_stochastic(state, torch.bfloat16, key)
    others = torch.randn(4, 8, 16, 32, generator=g)
    batch = torch.cat([others[:3], state, others[3:]])
    bkeys = torch.cat([keys_for([1, 2, 3]), key, keys_for([9])])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batched = round_stochastic(batch, torch.bfloat16, bkeys)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits(batched[3]), bits(alone[0]))
    pool = torch.zeros(8, 8, 16, 32, dtype=torch.bfloat16)
    pool[1] = round_stochastic(state, torch.bfloat16, key)[0]
    pool[6] = batched[3]
    assert torch.equal(bits(pool[1]), bits(pool[6]))


def test_different_position_layer_or_tensor_draws_differently():
    state = torch.randn(1, 4096, generator=torch.Generator().manual_seed(3))
    base = bits(round_stochastic(state, torch.bfloat16, keys_for([64])))
    for other in (keys_for([65]), keys_for([64], layer=4), keys_for([64], tensor="conv"),
                  keys_for([64], prefix=0x1235), keys_for([64], seed=8)):
        differ = float((bits(round_stochastic(state, torch.bfloat16, other)) != base).float().mean())
        assert 0.28 < differ < 0.39  # independent draws part with probability 2f(1-f): 1/3


def test_round_state_dispatch_and_refusals():
    x = torch.randn(2, 5)
    assert round_state(x, torch.float32, "stochastic") is x
    with pytest.raises(ValueError, match="needs stream keys"):
        round_state(x, torch.bfloat16, "stochastic")
    with pytest.raises(ValueError, match="not one of"):
        round_state(x, torch.bfloat16, "truncate", keys_for([1, 2]))
    with pytest.raises(ValueError, match="leading dims"):
        round_stochastic(x, torch.bfloat16, keys_for([1, 2, 3]))
    with pytest.raises(ValueError, match="reads float32"):
        round_stochastic(x.double(), torch.bfloat16, keys_for([1, 2]))


def test_bfloat16_fast_path_gives_the_general_paths_bytes():
    """bfloat16 rounds by adding bits below float32's upper half; the decision, hence every
    byte, equals the neighbour algorithm the float16 path uses (all magnitudes, subnormals,
    saturation, inf and nan)."""
    g = torch.Generator().manual_seed(4)
    scale = 10.0 ** torch.randint(-44, 38, (1, 50000), generator=g).float()
    special = torch.tensor([[3.39e38, -3.39e38, 3.4e38, -3.4e38, 1e-42, -1e-44, 0.0, -0.0,
                             float("inf"), -float("inf"), float("nan")]])
    x = torch.cat([torch.randn(1, 50000, generator=g) * scale, special], 1)
    r = draws(keys_for([9]), (x.shape[1],))
    fast, general = _bf16_stochastic(x, r), _neighbours_stochastic(x, torch.bfloat16, r)
    assert torch.equal(bits(fast), bits(general))


def test_the_fused_kernel_gives_the_references_bytes():
    """`round_kernel` (C++, one pass) stores every byte the torch reference stores: all
    magnitudes, subnormals, saturation, inf, several keys (negative ones too) and a TP index."""
    from baton.cache.round_kernel import kernel

    k = kernel()
    if k is None:
        pytest.skip("the rounding kernel cannot be built here")
    g = torch.Generator().manual_seed(5)
    scale = 10.0 ** torch.randint(-44, 38, (3, 20000), generator=g).float()
    x = torch.randn(3, 20000, generator=g) * scale
    x[0, :8] = torch.tensor([3.39e38, -3.39e38, 3.4e38, -3.4e38, 1e-42, -1e-44, 0.0, -0.0])
    x[1, :2] = torch.tensor([float("inf"), -float("inf")])
    keys = torch.tensor([-5, 2**62 + 3, keys_for([4]).item()])
    index = torch.randperm(20000, generator=g) * 1000003
    for idx in (None, index):
        r = draws(keys, (20000,), idx)
        want = _bf16_stochastic(x, r)
        got = round_stochastic(x, torch.bfloat16, keys, idx)  # dispatched to the kernel
        assert torch.equal(bits(got), bits(want))
