"""Baton's CPU kernel for decode-sized linears (`baton/model/layers/cpu_kernels/gemv.cpp`).

Accuracy: within a rigorous float32 rounding bound of a float64 reference, for float32,
float16 and bfloat16 weights. Exactness contract: a row's result is bit-identical alone or in
a batch of any size, at 1 or 2 threads, on every instruction set the CPU has. Wiring: the fast
decode path and the half-weight path use it, and without it they fall back to torch's kernels.
A build that fails logs one line and leaves `gemv()` None.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baton.model.layers import cpu_kernels, linear
from baton.model.layers.linear import FastLinear, decode_scope

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
U = 2.0 ** -24  # float32 unit roundoff
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}


def _data(m: int, n: int, k: int, dtype, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def _bound(x, w, b):
    """|error| of any float32 evaluation whose longest chain of roundings is ceil(K/16) lane
    steps + 4 tree levels + the bias add, each product exact inside its FMA."""
    depth = -(-x.shape[1] // 16) + 5
    mag = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return 1.01 * depth * U * mag


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 13, 15), (3, 37, 17), (16, 100, 77),
                                   (7, 41, 768), (12, 9, 100), (2, 64, 32)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matches_float64_within_rounding_bound(kernel, dtype, m, n, k, bias):
    x, w, b = _data(m, n, k, dtype, bias=bias)
    y = kernel.linear(x, w, b)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert y.dtype == torch.float32 and y.shape == (m, n)
    err = (y.double() - ref).abs()
    assert bool((err <= _bound(x, w, b)).all()), f"max error {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_every_instruction_set_gives_the_same_bits(kernel, dtype):
    # Odd K (a masked tail), N not a multiple of any register block, rows of every block size.
    x, w, b = _data(13, 75, 203, dtype, seed=1)
    want = kernel.linear(x, w, b, ISAS["scalar"])
    for isa in ISAS.values():
        assert torch.equal(kernel.linear(x, w, b, isa), want), isa


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("k", [31, 203, 1024, 1040, 2048])
def test_one_row_gives_the_same_bits_on_every_instruction_set(kernel, dtype, k):
    # AVX2 reads one row of half weights as one stream where K <= 1,024 or a row is a multiple
    # of 4 KiB, in 8-output blocks otherwise (`one_stream` in gemv_avx2.h): both sides, tails.
    x, w, b = _data(1, 21, k, dtype, seed=k)
    want = kernel.linear(x, w, b, ISAS["scalar"])
    for isa in ISAS.values():
        assert torch.equal(kernel.linear(x, w, b, isa), want), isa
    assert torch.equal(kernel.linear(x.expand(3, k).contiguous(), w, b, ISAS["avx2"])[1], want[0])


@pytest.mark.parametrize("n,k", [(16, 64), (23, 512), (1000, 768), (1031, 640)])
def test_one_row_in_eight_streams_gives_the_same_bits(kernel, n, k):
    # One row of f32 weights on AVX2 reads the range as eight streams (`strided256`: output
    # n0 + b + j * S, the blocks near each stream's end without prefetches, the last n % 8
    # outputs as before): every output as the scalar code and a row of a 3-row batch give it,
    # at 1 and 2 threads (each thread's range its own eight streams), with and without bias.
    x, w, b = _data(1, n, k, torch.float32, seed=n)
    want = kernel.linear(x, w, b, ISAS["scalar"])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for isa in ISAS.values():
                assert torch.equal(kernel.linear(x, w, b, isa), want), (isa, threads)
                assert torch.equal(kernel.linear(x, w, None, isa),
                                   kernel.linear(x, w, None, ISAS["scalar"])), (isa, threads)
            assert torch.equal(kernel.linear(x.expand(3, k).contiguous(), w, b)[2], want[0])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_a_row_alone_equals_the_row_in_any_batch_at_1_and_2_threads(kernel, dtype):
    # 600 outputs: enough weight for both threads to take a share.
    x, w, b = _data(64, 600, 203, dtype, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernel.linear(x[i:i + 1], w, b) for i in range(64)])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in range(1, 65):
                got = kernel.linear(x[:m], w, b)
                assert torch.equal(got, alone[:m]), f"{m} rows, {threads} threads"
            got = kernel.linear(x[5:17], w, b)  # rows at other places in a batch
            assert torch.equal(got, alone[5:17]), f"rows 5-16, {threads} threads"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("m,k,wide", [(5, 64, 100), (32, 768, 768), (1, 768, 768),
                                      (4, 1024, 1024), (3, 48, 52), (6, 40, 40)])
def test_rows_read_in_place_or_copied_give_the_same_bits(kernel, m, k, wide):
    # Rows of whole 16-lane chunks not a multiple of 4 KiB apart are read where they are (here
    # a column slice of wider rows, and contiguous K = 768); K = 1024 rows (4 KiB apart) and
    # K not a multiple of 16 take the padded copy. Each gives the contiguous copy's bits.
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, wide, generator=g)[:, :k]
    w = torch.randn(70, k, generator=g) * 0.1
    want = kernel.linear(x.contiguous(), w, None, ISAS["scalar"])
    for isa in ISAS.values():
        assert torch.equal(kernel.linear(x, w, None, isa), want), isa
    assert torch.equal(kernel.linear(x, w, None, -1, None, True),
                       torch.square(torch.nn.functional.relu(want)))


@pytest.mark.parametrize("threads", [1, 2])
def test_relu2_epilogue_is_torch_square_relu_bit_for_bit(kernel, threads):
    # NemotronH's MLP up projection with relu(y)^2 in the call (4 lanes at a time, no branch,
    # the tail past them scalar): torch.square(F.relu(y)) of the plain result, bit for bit, on
    # widths with and without a tail, with NaN, -0.0, +0.0, inf and -inf planted in y's rows
    # through a bias.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m, n in ((1, 7), (5, 37), (32, 600)):
            x, w, b = _data(m, n, 64, torch.float32, seed=n)
            b[:5] = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), float("-inf")])
            w[:5] = 0.0  # those outputs are their bias exactly
            plain = kernel.linear(x, w, b)
            want = torch.square(torch.nn.functional.relu(plain))
            got = kernel.linear(x, w, b, -1, None, True)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (m, n)
            assert got[:, 0].isnan().all() and (got[:, 1:3].view(torch.int32) == 0).all()
            assert (got < 0).sum() == 0 and bool((plain > 0).any() and (plain < 0).any())
    finally:
        torch.set_num_threads(before)


def test_two_threads_sharing_out_blocks_compute_each_output_once(kernel):
    # At 2 threads each thread takes its share of the 8-output blocks from the front, and one
    # done early takes blocks from the back of the other's (gemv_common.h split_blocks): every
    # output of `linear` (with a residual add), `linear_split` and `linear_cat` is the 1-thread
    # result, call after call (whichever thread happens to take which block), on widths that
    # leave a partial block and shares of unequal length.
    before = torch.get_num_threads()
    try:
        cases = []
        for m, n, k in ((32, 3608, 64), (8, 1001, 48), (1, 2049, 32)):
            x, w, b = _data(m, n, k, torch.float32, seed=n)
            r = torch.randn(m, n)
            w2 = _data(m, 531, k, torch.float32, seed=k)[1]
            cases.append((x, w, b, r, w2))
        torch.set_num_threads(1)
        want = [(kernel.linear(x, w, b, -1, r, False), kernel.linear_split(x, [w, w2]),
                 kernel.linear_cat(x, [w2, w])) for x, w, b, r, w2 in cases]
        torch.set_num_threads(2)
        for _ in range(20):
            for (x, w, b, r, w2), (y, split, cat) in zip(cases, want, strict=True):
                assert torch.equal(kernel.linear(x, w, b, -1, r, False), y)
                got = kernel.linear_split(x, [w, w2])
                assert torch.equal(got[0], split[0]) and torch.equal(got[1], split[1])
                assert torch.equal(kernel.linear_cat(x, [w2, w]), cat)
    finally:
        torch.set_num_threads(before)


def test_strided_inputs_and_bad_arguments(kernel):
    x, w, b = _data(4, 20, 48, torch.float32, seed=3)
    xt = x.t().contiguous().t()  # same values, column-major
    assert torch.equal(kernel.linear(xt, w, b), kernel.linear(x, w, b))
    assert kernel.linear(x[:0], w, b).shape == (0, 20)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernel.linear(x, w.t().contiguous().t(), b)  # K not contiguous
    with pytest.raises(RuntimeError, match="x must be"):
        kernel.linear(x.double(), w, b)


def _fast_linear(n: int, k: int, dtype, seed: int = 4) -> FastLinear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    lin.__class__ = FastLinear
    if dtype != torch.float32:
        lin.weight = torch.nn.Parameter(lin.weight.detach().to(dtype), requires_grad=False)
    return lin


@pytest.fixture
def fast_path():
    old = linear.set_decode_path("fast")
    yield
    linear.set_decode_path(old)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_fast_linear_takes_the_kernel_for_decode_rows(kernel, fast_path, dtype):
    lin = _fast_linear(96, 80, dtype)
    x = torch.randn(1, 9, 80)
    with torch.no_grad(), decode_scope():
        y = lin(x)
        rows = [lin(x[:, i:i + 1]) for i in range(9)]
    assert torch.equal(y, kernel.linear(x[0], lin.weight, lin.bias)[None])
    assert torch.equal(torch.cat(rows, dim=1), y)
    if dtype == torch.float32:  # the kernel reads the weight in place: no second copy
        assert lin._baton_packed[1].data_ptr() == lin.weight.data_ptr()


def test_fast_linear_takes_the_kernel_for_verify_sized_decode_rows(kernel, fast_path):
    """More than MAX_PACKED_ROWS decode rows (a verify pass of K+1 rows a request) stay on
    the kernel: each row as it is alone."""
    lin = _fast_linear(48, 80, torch.float32)
    x = torch.randn(linear.MAX_PACKED_ROWS * 2 + 3, 80)
    with torch.no_grad(), decode_scope():
        y = lin(x)
        assert torch.equal(y[7:8], lin(x[7:8]))
    assert torch.equal(y, kernel.linear(x, lin.weight, lin.bias))


def test_fast_path_prefill_rows_do_not_depend_on_their_chunk_nor_threads(fast_path):
    """Prefill matmuls on the fast path (oneDNN on the weight in place): a row's result is
    the same bits in a chunk of 1, 2, 3, 17 or 300 rows, at 1 and 2 threads, and within
    float32 rounding of float64."""
    lin = _fast_linear(200, 96, torch.float32)
    x = torch.randn(300, 96)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            full = lin(x[None])[0]
            torch.set_num_threads(2)
            assert torch.equal(lin(x), full)
            for m in (1, 2, 3, 17):
                assert torch.equal(lin(x[5:5 + m]), full[5:5 + m]), m
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        ref = x.double() @ lin.weight.double().T + lin.bias.double()
    assert float((full.double() - ref).abs().max()) < 1e-4
    linear.set_decode_path("reference")  # the reference path: MKL's sgemm, as it was
    with torch.no_grad():
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_without_the_kernel_the_fast_path_is_onednn_and_mkl(monkeypatch, fast_path):
    monkeypatch.setitem(cpu_kernels._cache, "gemv", None)
    lin = _fast_linear(96, 80, torch.float32)
    x = torch.randn(5, 80)
    w = lin.weight.detach()
    with torch.no_grad(), decode_scope():
        one, many = lin(x[:1]), lin(x)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, linear.PACK_HINT)
        want = torch.ops.mkldnn._linear_pointwise(x, packed, lin.bias, "none", [], "")
        assert torch.equal(one, torch.mm(x[:1], w.t().contiguous()) + lin.bias)
    assert torch.equal(many, want)
    half = _fast_linear(96, 80, torch.float16)
    with torch.no_grad():
        got = half(x)
    ref = x.double() @ half.weight.double().T + half.bias.double()
    assert bool(((got.double() - ref).abs() <= 1e-5).all())


def _subprocess_gemv(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from baton.model.layers import cpu_kernels\n"
            "print('module', cpu_kernels.gemv())\n")
    root = str(Path(__file__).resolve().parents[4])
    full = {**os.environ, "PYTHONPATH": root, "TORCH_EXTENSIONS_DIR": str(tmp_path), **env}
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=120, cwd=root)


def test_a_failed_build_logs_one_line_and_falls_back(tmp_path):
    out = _subprocess_gemv(tmp_path, CXX="/bin/false")
    assert out.returncode == 0, out.stderr
    assert "module None" in out.stdout
    lines = [ln for ln in out.stderr.splitlines() if "baton" in ln]
    assert len(lines) == 1 and "cpu kernels unavailable" in lines[0], out.stderr


def test_switched_off_builds_nothing(tmp_path):
    out = _subprocess_gemv(tmp_path, BATON_CPU_KERNELS="0")
    assert "module None" in out.stdout and "baton" not in out.stderr
    assert list(tmp_path.iterdir()) == []
