"""The kernel's several-matmul calls (`gemv.cpp`): `linear_cat` (several weights on one x: a
layer's input projections) and `grouped_linear` (runs of rows times their experts: MoE), and
`linear.fused_linears`, which takes `linear_cat` on the fast decode path. Each output must be
the same bits as the one-weight `linear` computes for it, at 1 and 2 threads, on every
instruction set."""

from __future__ import annotations

import pytest
import torch

from baton.model.layers import linear
from baton.model.layers.linear import FastLinear

ISAS = (0, 1, 2)  # scalar, avx2, avx512 (an ISA the CPU lacks falls back to the best one)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _w(n: int, k: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.1).to(dtype)


def test_linear_cat_is_each_weights_linear_side_by_side(kernel, threads):
    x = torch.randn(11, 203, generator=torch.Generator().manual_seed(1))
    ws = [_w(n, 203, dt, i) for i, (n, dt) in enumerate(
        [(300, torch.float32), (8, torch.float16), (75, torch.bfloat16), (1, torch.float32)])]
    want = torch.cat([kernel.linear(x, w) for w in ws], dim=1)
    for t in (1, 2):
        torch.set_num_threads(t)
        for isa in ISAS:
            assert torch.equal(kernel.linear_cat(x, ws, isa), want), (t, isa)
    assert torch.equal(kernel.linear_cat(x[3:4], ws), want[3:4])  # a row alone
    assert kernel.linear_cat(x, []).shape == (11, 0)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernel.linear_cat(x, [ws[0], _w(4, 200, torch.float32, 9)])


def test_grouped_linear_is_each_runs_linear(kernel, threads):
    x = torch.randn(9, 130, generator=torch.Generator().manual_seed(2))
    stack = torch.stack([_w(70, 130, torch.float32, i) for i in range(6)])
    counts = torch.tensor([0, 1, 0, 0, 8, 0])  # rows sorted by expert; idle experts
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        w = stack.to(dtype)
        want = torch.cat([kernel.linear(x[:1], w[1]), kernel.linear(x[1:], w[4])])
        for t in (1, 2):
            torch.set_num_threads(t)
            for isa in ISAS:
                got = kernel.grouped_linear(x, w, counts, isa=isa)
                assert torch.equal(got, want), (dtype, t)
        rows = torch.tensor([3, 0, 0, 8, 1, 2, 7, 7, 5])  # gathered rows, repeats
        assert torch.equal(kernel.grouped_linear(x, w, counts, rows),
                           kernel.grouped_linear(x[rows], w, counts))
    assert torch.equal(kernel.grouped_linear(x[:0], stack, torch.zeros(6, dtype=torch.long)),
                       torch.empty(0, 70))
    with pytest.raises(RuntimeError, match="counts hold 8 rows, x has 9"):
        kernel.grouped_linear(x, stack, torch.tensor([0, 0, 8, 0, 0, 0]))
    with pytest.raises(RuntimeError, match="counts must be"):
        kernel.grouped_linear(x, stack, torch.tensor([9]))
    with pytest.raises(RuntimeError, match="row 9 of x with 9"):
        kernel.grouped_linear(x, stack, counts, torch.tensor([9] * 9))


def test_moe_sort_and_combine_are_argsort_bincount_and_index_add(kernel):
    g = torch.Generator().manual_seed(5)
    experts = torch.stack([torch.randperm(10, generator=g)[:3] for _ in range(7)])  # [7, 3]
    weights = torch.rand(7, 3, generator=g)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    pair, token, counts = kernel.moe_sort(experts, 0, 10, 10)
    assert torch.equal(pair, order) and torch.equal(token, order // 3)
    assert torch.equal(counts, torch.bincount(flat, minlength=10))
    ys = torch.randn(21, 33, generator=g)
    want = torch.zeros(7, 33).index_add_(0, order // 3, ys * weights.flatten()[order, None])
    assert torch.equal(kernel.moe_combine(ys, pair, token, weights.flatten(), 7), want)
    # experts [4, 7) held here: their pairs only, in the same order; counts still of all 10
    pair, token, counts = kernel.moe_sort(experts, 4, 3, 10)
    assert torch.equal(pair, order[(flat[order] >= 4) & (flat[order] < 7)])
    assert torch.equal(counts, torch.bincount(flat, minlength=10))
    with pytest.raises(RuntimeError, match="expert 12 of 10"):
        kernel.moe_sort(torch.tensor([[12]]), 0, 10, 10)


def _layer(n: int, k: int, dtype, bias: bool = False, seed: int = 0) -> FastLinear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    lin.__class__ = FastLinear
    lin.weight = torch.nn.Parameter(lin.weight.detach().to(dtype), requires_grad=False)
    return lin


def test_fused_linears_on_the_fast_path_only(kernel):
    layers = [_layer(40, 96, torch.float32, seed=1), _layer(8, 96, torch.float16, seed=2)]
    x = torch.randn(5, 1, 96)
    old = linear.set_decode_path("fast")
    try:
        with torch.no_grad():
            assert linear.fused_linears(x, *layers) is None  # not a marked decode call
            with linear.decode_scope():
                outs = linear.fused_linears(x, *layers)
                assert [o.shape for o in outs] == [(5, 1, 40), (5, 1, 8)]
                for o, lin in zip(outs, layers, strict=True):
                    assert torch.equal(o, lin(x))
                # a bare weight; a layer with a bias is not fused
                assert torch.equal(linear.fused_linears(x, layers[0].weight)[0], outs[0])
                assert linear.fused_linears(x, _layer(8, 96, torch.float32, bias=True)) is None
                many = torch.randn(80, 96)  # a verify pass's rows: any row count
                assert torch.equal(linear.fused_linears(many, *layers)[1], layers[1](many))
        linear.set_decode_path("reference")
        with torch.no_grad(), linear.decode_scope():
            assert linear.fused_linears(x, *layers) is None
    finally:
        linear.set_decode_path(old)
