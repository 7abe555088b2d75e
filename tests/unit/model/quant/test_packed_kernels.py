"""Packed int8 / int4 weights (`baton/model/quant/packed.py`) read as stored by Baton's CPU
kernels (`cpu_kernels/gemv_kernels.h` kI8 / kI4): on every instruction set (AVX-512, AVX2,
plain) each output equals the float kernel's on the dequantized weight bit for bit, for odd
shapes (K tails, N off the register blocks), every row-block size, `linear_cat` beside float
weights and `grouped_linear` over expert stacks; a row's result does not depend on its batch
or the thread count; the dequantized weight is the loader's reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from baton.model.layers import linear
from baton.model.layers.linear import FastLinear, decode_scope
from baton.model.quant import packed
from baton.model.quant.quantize import decode, encode

ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
SHAPES = {"int8": [(1, 1, 1), (1, 13, 15), (3, 37, 17), (16, 100, 77), (7, 41, 768),
                   (13, 75, 203), (2, 64, 32), (1, 21, 1040)],
          "int4": [(1, 1, 32), (1, 13, 64), (3, 37, 96), (16, 100, 224), (7, 41, 768),
                   (13, 75, 1056), (2, 9, 32)]}
SHAPES["int8g"] = SHAPES["int8"] + [(3, 11, 33), (2, 7, 95)]  # partial last groups
CASES = [(mode, *s) for mode, shapes in SHAPES.items() for s in shapes]


def _data(m, n, k, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, n, k, generator=g) * 0.1
    return torch.randn(m, k, generator=g), w, torch.randn(n, generator=g)


@pytest.mark.parametrize("mode,m,n,k", CASES)
def test_every_instruction_set_equals_the_float_kernel_on_the_dequantized_weight(
        kernel, mode, m, n, k):
    x, w, b = _data(m, n, k, seed=n * k)
    p = packed.pack(w, mode)
    d = packed.dense(p)
    assert torch.equal(d, decode(encode(w, mode), mode))  # the loader's reference
    assert (d - w).abs().max() <= w.abs().max() / (7 if mode == "int4" else 127)
    for isa in ISAS.values():
        want = kernel.linear(x, d, b, isa)
        assert torch.equal(kernel.linear(x, p, b, isa), want), isa
        assert torch.equal(kernel.linear(x, p, None, isa), kernel.linear(x, d, None, isa)), isa
    ref = x.double() @ d.double().T + b.double()
    assert torch.allclose(kernel.linear(x, p, b), ref.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["int8", "int8g", "int4"])
def test_a_row_alone_equals_the_row_in_any_batch_at_1_and_2_threads(kernel, mode):
    x, w, b = _data(40, 600, 224, seed=3)
    p = packed.pack(w, mode)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernel.linear(x[i:i + 1], p, b) for i in range(40)])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 7, 8, 13, 33, 40):
                assert torch.equal(kernel.linear(x[:m], p, b), alone[:m]), (m, threads)
            assert torch.equal(kernel.linear(x[5:17], p, b), alone[5:17]), threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", sorted(ISAS))
def test_linear_cat_mixes_packed_and_float_weights(kernel, isa):
    x, w, _ = _data(5, 70, 96, seed=5)
    parts = [packed.pack(w[:30], "int8"), w[30:50].contiguous(), packed.pack(w[50:], "int4")]
    dense = [packed.dense(t) for t in parts]
    got = kernel.linear_cat(x, parts, ISAS[isa])
    assert torch.equal(got, kernel.linear_cat(x, dense, ISAS[isa]))
    split = kernel.linear_split(x, parts, ISAS[isa])
    assert all(torch.equal(a, c) for a, c in zip(split, kernel.linear_split(x, dense, ISAS[isa]), strict=True))


@pytest.mark.parametrize("mode", ["int8", "int8g", "int4"])
@pytest.mark.parametrize("isa", sorted(ISAS))
def test_grouped_linear_reads_packed_expert_stacks(kernel, mode, isa):
    # [E, N, K] stacks (MoE experts) packed as one tensor; runs of rows per expert.
    x, w, _ = _data(9, 40, 64, seed=7, lead=(5,))
    p = packed.pack(w, mode)
    assert p.shape == w.shape and torch.equal(packed.dense(p[3]), packed.dense(p)[3])
    counts = torch.tensor([2, 0, 4, 1, 2])
    want = kernel.grouped_linear(x, packed.dense(p), counts, None, ISAS[isa])
    assert torch.equal(kernel.grouped_linear(x, p, counts, None, ISAS[isa]), want)


@pytest.mark.parametrize("mode", ["int8", "int8g", "int4"])
def test_fast_linear_decode_prefill_and_reference_paths(kernel, mode):
    # FastLinear with a packed weight: decode takes the kernel (the float kernel's bits on the
    # dequantized weight), a prefill decodes QUANT_TILE rows at a time (a row's bits do not
    # depend on its chunk), the reference path the dequantized layer; all agree within float32
    # rounding.
    x, w, b = _data(300, 600, 128, seed=11)
    lin = FastLinear(128, 600)
    ref_lin = FastLinear(128, 600)
    with torch.no_grad():
        ref_lin.weight.copy_(decode(encode(w, mode), mode))
        ref_lin.bias.copy_(b)
        lin.weight = torch.nn.Parameter(packed.pack(w, mode), requires_grad=False)
        lin.bias.copy_(b)
        with decode_scope():
            assert torch.equal(lin(x[:7]), ref_lin(x[:7]))
        whole = lin(x)
        assert torch.equal(lin(x[100:160]), whole[100:160])
        assert torch.allclose(whole, ref_lin(x), atol=1e-5, rtol=1e-5)
        with linear.reference_scope():
            assert torch.allclose(lin(x), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [32, 95, 200, 256])
def test_int8g_layout_cut_cat_stack_and_lookup(k):
    # int8 per 32 columns (float16 scales, the values q + 128 in the integer path's lane
    # order): the tag tells it from per-row int8; cut / cat / stack and an embedding lookup
    # give `dense`'s bits; the scales are amax / 127 per group, rounded to float16.
    _, w, _ = _data(1, 9, k, seed=k, lead=(2,))
    w[0, 3, :7] = 0  # a zero group start, and a zero row part
    p = packed.pack(w, "int8g")
    assert packed.kind(p) == "int8g" and packed.kind(packed.pack(w, "int8")) == "int8"
    d = packed.dense(p)
    s = packed.scales(p)
    assert s.dtype == torch.float16 and s.shape == (2, 9, -(-k // 32))
    g = torch.nn.functional.pad(w, (0, -k % 32)).unflatten(-1, (-1, 32))
    assert torch.equal(s, (g.abs().amax(-1) / 127).to(torch.float16))
    q = packed.values(p)
    assert q.abs().max() <= 127 and torch.equal(d, q.float() * s.float().repeat_interleave(
        32, -1)[..., :k])
    assert (d - w).abs().max() <= w.abs().max() / 127
    assert torch.equal(packed.dense(packed.cut(p, (1, slice(2, 7)))), d[1, 2:7])
    if k > 32:
        assert torch.equal(packed.dense(packed.cut(p, (0, slice(None), slice(32, k)))),
                           d[0, :, 32:])
    assert torch.equal(packed.dense(packed.cat([p[0], p[1]])), torch.cat([d[0], d[1]]))
    st = packed.stack([p[0], p[1]], (2, 9, k))
    assert packed.kind(st) == "int8g" and torch.equal(packed.dense(st), d)
    table = packed.PackedEmbedding(packed.pack(w[1], "int8g"))
    ids = torch.tensor([[3, 0], [8, 3]])
    assert torch.equal(table(ids), d[1][ids])


def test_bad_packed_weights_are_refused_in_one_line(kernel):
    with pytest.raises(ValueError, match="packed int8: a row scale that is not finite"):
        packed.pack_int8(torch.ones(2, 4, dtype=torch.int8), torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="int8 per 32 columns: a weight of magnitude 1e"):
        packed.pack(torch.full((2, 40), 1e7), "int8g")
    with pytest.raises(ValueError, match="int4 weight of width 40: a multiple of 32"):
        packed.pack(torch.randn(3, 40), "int4")
    odd = torch.zeros(4, 48, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="packed int4 weight of width 48: a multiple of 32"):
        kernel.linear(torch.randn(1, 48), odd)


@pytest.mark.parametrize("k", [17, 128, 200, 1100])
def test_fp8_weights_on_every_instruction_set(kernel, k):
    # every e4m3 code but NaN (subnormals, -0.0, the largest), a scale per 128 columns (the
    # last group partial): fp32(q) * s exactly, the float kernel's bits on it on every ISA
    g = torch.Generator().manual_seed(k)
    q = torch.randint(0, 256, (9, k), generator=g, dtype=torch.uint8)
    codes = torch.arange(256, dtype=torch.uint8)
    q.view(-1)[:254] = codes[(codes & 0x7F) != 0x7F][:min(254, q.numel())]
    q[(q & 0x7F) == 0x7F] = 0
    q = q.view(torch.float8_e4m3fn)
    s = torch.rand(9, -(-k // 128), generator=g) + 0.5
    p = packed.pack_fp8(q, s)
    want_w = q.to(torch.float32) * s.repeat_interleave(128, -1)[:, :k]
    assert torch.equal(packed.dense(p), want_w)
    for m in (1, 3, 13):
        x = torch.randn(m, k, generator=g)
        want = kernel.linear(x, want_w, None, 0)
        for isa in ISAS.values():
            assert torch.equal(kernel.linear(x, p, None, isa), want), (m, isa)


@pytest.mark.parametrize("k", [16, 48, 224, 1040])
def test_nvfp4_weights_on_every_instruction_set(kernel, k):
    # every e2m1 code, e4m3 group scales, the tensor scale: formats.nvfp4's bits, and the
    # float kernel's on them on every ISA; two stacked experts with their own tensor scales
    from baton.model.quant import formats

    g = torch.Generator().manual_seed(k)
    q = torch.randint(0, 256, (2, 9, k // 2), generator=g, dtype=torch.uint8)
    s = (torch.rand(2, 9, k // 16, generator=g) * 4 + 0.01).to(torch.float8_e4m3fn)
    s2 = torch.tensor([0.013, 0.021])
    p = packed.stack([packed.pack_nvfp4(q[e], s[e], s2[e]) for e in range(2)], (2, 9, k))
    for e in range(2):
        want_w = formats.nvfp4(q[e], s[e], s2[e])
        assert torch.equal(packed.dense(p[e]), want_w)
        for m in (1, 3, 13):
            x = torch.randn(m, k, generator=g)
            want = kernel.linear(x, want_w, None, 0)
            for isa in ISAS.values():
                assert torch.equal(kernel.linear(x, p[e], None, isa), want), (e, m, isa)


def test_weight_dtype_leaves_packed_weights_alone():
    # model.weight_dtype casts float linears and expert stacks; packed weights (fp8 is a float
    # dtype to torch) keep their bytes and scales
    from baton.model.layers.linear import cast_weights

    w = torch.randn(40, 256) * 0.1
    m = torch.nn.Sequential(FastLinear(256, 40, bias=False), FastLinear(256, 40, bias=False))
    m[0].weight = torch.nn.Parameter(packed.pack_fp8(w.to(torch.float8_e4m3fn),
                                                     torch.ones(40, 2)), requires_grad=False)
    before = packed.dense(m[0].weight)
    cast_weights(m, torch.bfloat16)
    assert packed.kind(m[0].weight) == "fp8" and torch.equal(packed.dense(m[0].weight), before)
    assert m[1].weight.dtype == torch.bfloat16
