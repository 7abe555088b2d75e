"""The fast path's prefill kernels (step_kernels prefill.cpp) against the eager ops they replace:
the conv + silu, the gated norms of both families, the SSD / DeltaNet decay matrices, the
unit-lower-triangular solve and causal attention agree to float32 rounding; and each token's
result does not depend on the rows beside it (a prompt cut in two, the state carried, gives the
same bits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from baton.model.layers.gated_norms import HeadGatedRMSNorm
from baton.model.layers.norms import GatedRMSNorm
from baton.model.layers.step_kernels import kernels

K = kernels()
pytestmark = pytest.mark.skipif(K is None, reason="step kernels not built on this machine")


def _gen(seed: int = 0):
    return torch.Generator().manual_seed(seed)


def _conv_ref(x, state, w, bias, silu=True):
    """Mamba2Mixer._conv's formula on the window [state | x], token-major out (before the silu
    where silu is False)."""
    window = torch.cat([state, x.transpose(1, 2)], dim=-1)
    n = x.shape[1]
    out = window[..., 0:n] * w[:, 0:1]
    for k in range(1, w.shape[1]):
        out = out + window[..., k:k + n] * w[:, k:k + 1]
    if bias is not None:
        out = out + bias[:, None]
    return (F.silu(out) if silu else out).transpose(1, 2)


@pytest.mark.parametrize("bias", [True, False])
def test_conv_silu_matches_the_eager_conv_and_carries_its_state_exactly(bias):
    g = _gen()
    C, Kw, T = 40, 4, 37
    wide = torch.randn(2, T, C + 9, generator=g)  # a column slice: rows strided
    x = wide[..., 3:3 + C]
    state = torch.randn(2, C, Kw - 1, generator=g)
    w = torch.randn(C, Kw, generator=g)
    b = torch.randn(C, generator=g) if bias else None
    out = K.conv_silu(x, state, w, b)
    assert out.shape == (2, T, C) and out.is_contiguous()
    assert torch.allclose(out, _conv_ref(x, state, w, b), atol=1e-6, rtol=1e-6)
    # cut at 10: the second part starts from the first part's last K-1 inputs
    first = K.conv_silu(x[:, :10], state, w, b)
    tail = x[:, 10 - (Kw - 1):10].transpose(1, 2).contiguous()
    second = K.conv_silu(x[:, 10:], tail, w, b)
    assert torch.equal(torch.cat([first, second], dim=1), out)


@pytest.mark.parametrize("C", [40, 43])
def test_conv_silu_takes_std_exp_bits_on_every_build(C):
    """The conv's sums in the reference's order, then x / (1 + exp(-x)) with std::exp's exp, bit
    for bit (8 lanes at a time and a tail); on an AVX-512 build too, where the silu once took
    Sleef's 16-lane exp (~1 ulp off)."""
    g = _gen(2)
    x = torch.randn(2, 29, C, generator=g) * 4
    state = torch.randn(2, C, 3, generator=g)
    w = torch.randn(C, 4, generator=g)
    b = torch.randn(C, generator=g)
    pre = _conv_ref(x, state, w, b, silu=False).contiguous()
    want = pre / (1 + K.prefill_exp(-pre, False))
    assert torch.equal(K.conv_silu(x, state, w, b), want)


@pytest.mark.parametrize("norm_first", [False, True])
def test_gated_rms_norm_matches_each_family_and_rows_stand_alone(norm_first):
    g = _gen(1)
    D, group, rows = 48, 12, 9
    y = torch.randn(rows, D, generator=g)
    gate = torch.randn(rows, D + 5, generator=g)[:, 2:2 + D]  # strided rows
    if norm_first:  # Qwen3.5's DeltaNet: per head, weight [head_dim]
        ref = HeadGatedRMSNorm(group, 1e-6)
    else:  # NemotronH's Mamba2: per group, weight [D]
        ref = GatedRMSNorm(D, group, 1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(ref.weight.shape, generator=g))
    out = K.gated_rms_norm(y, gate, ref.weight, group, ref.eps, norm_first)
    with torch.no_grad():
        assert torch.allclose(out, ref(y, gate), atol=1e-6, rtol=1e-5)
    alone = K.gated_rms_norm(y[4:5], gate[4:5], ref.weight, group, ref.eps, norm_first)
    assert torch.equal(alone, out[4:5])


def test_ssd_decay_is_the_masked_decay_times_the_shared_product():
    g = _gen(2)
    b, G, r, c, L, N = 1, 2, 3, 2, 8, 5
    CB = torch.randn(b, G, c, L, L, generator=g)
    cum = (-torch.rand(b, G * r, c, L, generator=g)).double().cumsum(-1)
    C = torch.randn(b, G, c, L, N, generator=g)
    got = K.ssd_decay(CB, cum, r, C)
    decay = (cum[..., :, None] - cum[..., None, :]).exp().tril().float()
    M = decay.view(b, G, r, c, L, L) * CB[:, :, None]
    tail = C[:, :, None] * cum.exp().float().view(b, G, r, c, L, 1)
    want = torch.cat([M, tail], dim=-1).view(b, G * r, c, L, L + N)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(K.ssd_decay(CB, cum, r, None), got[..., :L])


def test_unit_lower_solve_matches_solve_triangular():
    g = _gen(3)
    A = torch.randn(6, 16, 16, generator=g) * 0.3
    rhs = torch.randn(6, 16, 24, generator=g)
    want = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    got = K.unit_lower_solve(A, rhs)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)



def _sdpa(q, k, v, pos, scale):
    """SDPA with the kernel's layout and masking: q [n, T, H, D] at positions pos [n, T]
    over k, v [n, Hk, S, D] (a query at p reads keys 0..p)."""
    S = k.shape[2]
    hidden = torch.arange(S)[None, None, None, :] > pos[:, None, :, None]
    mask = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[2] != k.shape[1])
    return out.transpose(1, 2)


@pytest.mark.parametrize("shape", [(1, 200, 4, 2, 32), (2, 37, 12, 4, 64), (1, 90, 4, 4, 24),
                                   (3, 5, 2, 1, 256), (1, 70, 8, 2, 128), (2, 19, 8, 1, 12),
                                   (1, 40, 6, 6, 8)])
def test_prefill_attention_matches_sdpa(shape):
    """n sequences of T queries (H heads over Hk key heads, head size D) at different starts,
    one of them shorter than the key count (its padding keys must not count): SDPA's values to
    float32 rounding."""
    n, T, H, Hk, D = shape
    g = _gen(7)
    starts = [0, 40, 11][:n]
    S = max(starts) + T
    q = torch.randn(n, T, H, D, generator=g)
    k, v = torch.randn(2, n, Hk, S, D, generator=g)
    pos = torch.arange(T)[None, :] + torch.tensor(starts)[:, None]
    got = K.prefill_attention(q, k, v, pos, D**-0.5)
    assert got.shape == (n, T, H, D)
    assert torch.allclose(got, _sdpa(q, k, v, pos, D**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_attention_rows_do_not_depend_on_the_call(threads):
    """A query's output is the same bits whole, in a prompt cut anywhere (its parts reading the
    earlier keys), alone, and on 1 or 2 threads: each row is computed in its own fixed order
    (SDPA's CPU kernel and BLAS split the key sums by the matrix sizes; on an AVX2 machine a
    200-token prompt cut at 128 differed in rows 100-127)."""
    T, H, Hk, D = 333, 12, 4, 64
    g = _gen(8)
    q = torch.randn(1, T, H, D, generator=g)
    k, v = torch.randn(2, 1, Hk, T, D, generator=g)
    pos = torch.arange(T)[None]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = K.prefill_attention(q, k, v, pos, D**-0.5)
        torch.set_num_threads(threads)
        for cuts in ((128,), (100,), (1, 2, 64, 65, 200, 332)):
            parts, s = [], 0
            for e in (*cuts, T):
                parts.append(K.prefill_attention(q[:, s:e], k[:, :, :e], v[:, :, :e],
                                                 pos[:, s:e], D**-0.5))
                s = e
            assert torch.equal(torch.cat(parts, 1), whole), cuts
        for t in (0, 5, 199, T - 1):
            alone = K.prefill_attention(q[:, t:t + 1], k, v, pos[:, t:t + 1], D**-0.5)
            assert torch.equal(alone, whole[:, t:t + 1]), t
    finally:
        torch.set_num_threads(old)


def test_prefill_attention_refuses_shapes_it_does_not_take():
    pos = torch.arange(4)[None]
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 4, 16)
    with pytest.raises(RuntimeError, match="multiple of Hk"):
        K.prefill_attention(q, k, k, pos, 1.0)
    with pytest.raises(RuntimeError, match="pos long"):
        K.prefill_attention(torch.randn(1, 4, 2, 16), k, k, pos.int(), 1.0)


@pytest.mark.skipif(K is None or not K.prefill_gemm_built(),
                    reason="prefill_gemm is built for AVX2 machines without AVX-512")
@pytest.mark.parametrize("M,N,Kd", [(300, 768, 1280), (37, 50, 33), (7, 17, 256), (64, 96, 257),
                                    (601, 40, 520)])
def test_prefill_gemm_rows_are_their_own_at_any_count_chunk_and_thread(M, N, Kd):
    """x w^T + b within float32 rounding of float64 (no worse than MKL's sgemm: K summed in
    blocks), and each row the same bits alone, in chunks of 1, 7 or 100 rows, from a strided
    view, and at 1 or 2 threads, for row counts and widths that leave partial tiles (601 rows:
    several row blocks a thread, each ending in a partial tile)."""
    g = _gen(12)
    x, w, b = torch.randn(M, Kd, generator=g), torch.randn(N, Kd, generator=g), torch.randn(N, generator=g)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = K.prefill_gemm(x, w, b)
        exact = x.double() @ w.double().t() + b.double()
        mkl = (torch.addmm(b, x, w.t()).double() - exact).abs().max().item()
        assert (whole.double() - exact).abs().max().item() <= 2 * mkl + 1e-6
        assert torch.equal(K.prefill_gemm(x, w, None) + b, whole)  # the bias added last
        wide = torch.randn(M, Kd + 5, generator=g)
        wide[:, 2:2 + Kd] = x
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(K.prefill_gemm(x, w, b), whole)
            assert torch.equal(K.prefill_gemm(wide[:, 2:2 + Kd], w, b), whole)
            for step in (1, 7, 100):
                parts = [K.prefill_gemm(x[i:i + step], w, b) for i in range(0, M, step)]
                assert torch.equal(torch.cat(parts), whole), step
    finally:
        torch.set_num_threads(old)


def test_prefill_gemm_refuses_shapes_it_does_not_take():
    if K is None or not K.prefill_gemm_built():
        pytest.skip("prefill_gemm not built here")
    with pytest.raises(RuntimeError, match="with x's K"):
        K.prefill_gemm(torch.randn(4, 8), torch.randn(3, 9), None)
    with pytest.raises(RuntimeError, match="rows contiguous"):
        K.prefill_gemm(torch.randn(8, 4).t(), torch.randn(3, 8), None)
    with pytest.raises(RuntimeError, match="bias must be"):
        K.prefill_gemm(torch.randn(4, 8), torch.randn(3, 8), torch.randn(4))


@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_mm_is_each_experts_one_thread_mm_bit_for_bit(threads):
    """Each expert's run of rows times its weight, as torch.mm computes it at one thread,
    whatever the thread count, for runs of 0, 1, 5-11 rows (where MKL's sgemm at 2 threads
    rounds differently from 1) up to 300, in any order of sizes."""
    g = _gen(11)
    counts = torch.tensor([7, 0, 300, 1, 5, 0, 64, 11, 9, 2])
    w = torch.randn(len(counts), 96, 80, generator=g)
    xs = torch.randn(int(counts.sum()), 80, generator=g)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        runs = xs.split(counts.tolist())
        want = torch.cat([torch.mm(r, w[e].t()) for e, r in enumerate(runs)])
        torch.set_num_threads(threads)
        for _ in range(5):  # the experts' order among the threads varies from call to call
            assert torch.equal(K.grouped_mm(xs, w, counts), want)
        assert K.grouped_mm(xs[:0], w, torch.zeros(len(counts), dtype=torch.long)).shape == (0, 96)
    finally:
        torch.set_num_threads(old)


def test_grouped_mm_refuses_counts_that_do_not_cover_the_rows():
    xs, w = torch.randn(10, 8), torch.randn(3, 4, 8)
    with pytest.raises(RuntimeError, match="sum to 9, not the 10"):
        K.grouped_mm(xs, w, torch.tensor([4, 0, 5]))
    with pytest.raises(RuntimeError, match="not be negative"):
        K.grouped_mm(xs, w, torch.tensor([12, -2, 0]))
    with pytest.raises(RuntimeError, match=r"\[E\] int64"):
        K.grouped_mm(xs, w, torch.tensor([4, 6]))
    with pytest.raises(RuntimeError, match="K = the rows"):
        K.grouped_mm(xs, torch.randn(3, 4, 9), torch.tensor([4, 0, 6]))


@pytest.mark.parametrize("cuts", [(64,), (128,), (64, 128, 192)])
def test_a_prompt_cut_at_scan_chunk_boundaries_equals_whole(model_tiny, cuts):
    """The tiny NemotronH on the fast path, 200 prompt tokens whole and cut at multiples of
    the scan's 64-token chunk (the state carried through the pool): the same logits, bit for
    bit (a part's final state is carried as a longer call carries it into its next chunk). A
    cut inside a chunk computes that chunk's remainder from a carried state instead of its
    closed form (about 1e-6), so it is not compared."""
    from baton.model.layers import linear
    from baton.model.layers.ssd_fast import CHUNK

    assert all(c % CHUNK == 0 for c in cuts)
    ids = torch.randint(3, 512, (200,), generator=_gen(6))
    old = linear.set_decode_path("fast")
    try:
        runs = []
        for ends in ((200,), (*cuts, 200)):
            pools, start, parts = model_tiny.make_pools(16, 16, 2), 0, []
            for end in ends:
                parts.append(model_tiny.prefill(ids[start:end], start, list(range(16)), 1,
                                                pools, all_logits=True))
                start = end
            runs.append(torch.cat(parts))
    finally:
        linear.set_decode_path(old)
    assert torch.equal(runs[0], runs[1])


def _denormal(t: torch.Tensor) -> int:
    return int(((t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)).sum())


def _flushes() -> bool:
    """Whether this thread flushes float32 denormals now (a denormal times 1 gives 0)."""
    return _denormal(torch.full((4,), 1e-40) * torch.ones(4)) == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_flush_denormals_sets_every_pool_thread_and_reports_the_old_state(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert not _flushes()
        assert K.flush_denormals(True) is False
        # a product big enough to split over the pool: no thread may keep a denormal
        assert _denormal(torch.full((1 << 20,), 1e-20) * torch.full((1 << 20,), 1e-20)) == 0
        assert K.flush_denormals(False) is True
        assert _denormal(torch.full((1 << 20,), 1e-20) * torch.full((1 << 20,), 1e-20)) == 1 << 20
    finally:
        K.flush_denormals(False)
        torch.set_num_threads(old)


def _decaying_scan_inputs():
    """A DeltaNet and a Mamba2 scan over 256 tokens whose decays sit just above the scans'
    FLUSH (e^-60 within a chunk) and whose inputs are small: their products and partial sums
    are float32 denormals (what made the bench models' scans slow)."""
    g = _gen(3)
    n, T, HK, HV, dk, dv = 1, 256, 2, 4, 16, 16
    q, k = torch.randn(n, T, HK, dk, generator=g), torch.randn(n, T, HK, dk, generator=g)
    v = torch.randn(n, T, HV, dv, generator=g) * 1e-20
    gate = -torch.rand(n, T, HV, generator=g) * 1.9  # ~-60 over a 64-token chunk
    beta = torch.rand(n, T, HV, generator=g)
    H, P, G, N = 4, 8, 2, 8
    x = torch.randn(n, T, H, P, generator=g) * 1e-20
    dt = torch.rand(n, T, H, generator=g) * 0.9 + 0.05
    A = -torch.rand(H, generator=g) * 2
    B, C = (torch.randn(n, T, G, N, generator=g) for _ in range(2))
    return (q, k, v, gate, beta), (x, dt, A, B, C, torch.randn(H, generator=g))


class _MatmulDenormals(TorchFunctionMode):
    """Counts the denormal elements in the tensors the scans' matmuls take and give."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("baddbmm", "matmul", "__matmul__", "bmm"):
            self.n += sum(_denormal(t) for t in (*args, out) if isinstance(t, torch.Tensor)
                          and t.dtype == torch.float32)
        return out


def test_the_scans_flush_denormals_only_while_they_run_and_keep_their_bits():
    """`denormals_flushed` around the prefill scans: the outputs and final states are the
    bits of the same scan with denormals kept (whose outputs are not themselves that small),
    and the thread flushes nothing after."""
    import contextlib

    from baton.model.layers import gdn_fast, ssd_fast

    dn, m2 = _decaying_scan_inputs()
    runs, seen, flushed = {}, {}, ssd_fast.denormals_flushed
    for name, cm in (("flushed", flushed), ("kept", contextlib.nullcontext)):
        ssd_fast.denormals_flushed = gdn_fast.denormals_flushed = cm
        try:
            with _MatmulDenormals() as count:
                runs[name] = (gdn_fast.chunk_scan_fast(*dn, None), ssd_fast.ssd_scan_fast(*m2))
            seen[name] = count.n
        finally:
            ssd_fast.denormals_flushed = gdn_fast.denormals_flushed = flushed
        assert not _flushes()
    assert seen["kept"] > 0 and seen["flushed"] == 0  # the inputs do make denormals
    for a, b in zip(runs["flushed"], runs["kept"], strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)


def _decay_inputs(seed, b=1, G=2, r=3, c=3, L=8, N=5):
    g = _gen(seed)
    CB = torch.randn(b, G, c, L, L, generator=g)
    cum = (-torch.rand(b, G * r, c, L, generator=g)).double().cumsum(-1)
    C = torch.randn(b, G, c, L, N, generator=g)
    return CB, cum, C


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("P,with_C", [(16, True), (32, True), (16, False)])
def test_decay_matmul_is_the_decay_matrix_times_X_row_by_row(P, with_C, threads):
    """The scans' fused output matmul equals ssd_decay's matrix times X (within float32
    rounding of a float64 product), and a block's rows are their own bits: the same in a call
    over fewer chunks, at any thread count."""
    b, G, r, c, L, N = 2, 2, 3, 3, 8, 5
    CB, cum, C = _decay_inputs(4, b, G, r, c, L, N)
    C = C if with_C else None
    W = L + (N if with_C else 0)
    X = torch.randn(b, G * r, c, W, P, generator=_gen(5))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = K.decay_matmul(CB, cum, r, C, X)
        part = K.decay_matmul(CB[:, :, 1:].contiguous(), cum[:, :, 1:].contiguous(), r,
                              None if C is None else C[:, :, 1:].contiguous(),
                              X[:, :, 1:].contiguous())
    finally:
        torch.set_num_threads(old)
    want = (K.ssd_decay(CB, cum, r, C).double() @ X.double()).float()
    assert got.shape == (b, G * r, c, L, P)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(part, got[:, :, 1:])
    assert torch.equal(K.decay_matmul(CB, cum, r, C, X), got)


def test_decay_matmul_refuses_shapes_it_does_not_take():
    CB, cum, C = _decay_inputs(6)
    X = torch.randn(1, 6, 3, 13, 16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        K.decay_matmul(CB, cum, 3, C, torch.randn(1, 6, 3, 13, 12))
    with pytest.raises(RuntimeError, match="X must be"):
        K.decay_matmul(CB, cum, 3, C, torch.randn(1, 6, 3, 12, 16))  # rows != l + N
    with pytest.raises(RuntimeError, match="CB/cum"):
        K.decay_matmul(CB, cum, 2, C, X)  # 2 groups of 2 heads != 6 heads
    assert K.decay_matmul(CB, cum, 3, C, X).shape == (1, 6, 3, 8, 16)


@pytest.mark.parametrize("with_state", [True, False])
def test_ssd_carry_gives_the_addcmul_loops_bits(with_state):
    """The carried states (into X's rows L..) and the final state: the bits of the torch loop
    it replaces (`ssd_fast._carry`), chunk 0 starting from the given state or zeros."""
    from baton.model.layers import ssd_fast

    g = _gen(7)
    b, G, c, N, r, P, L = 2, 2, 5, 6, 3, 8, 4
    states = torch.randn(b, G, c, N, r, P, generator=g)
    decay = torch.rand(b, G * r, c, generator=g)
    state = torch.randn(b, G * r, P, N, generator=g) if with_state else None
    X0 = torch.randn(b, G * r, c, L + N, P, generator=g)
    Xk, Xt = X0.clone(), X0.clone()
    got = K.ssd_carry(states, decay, Xk, state, L)
    want = ssd_fast._carry(states, decay, Xt, state, L)
    assert torch.equal(got, want) and torch.equal(Xk, Xt)
    assert torch.equal(Xk[:, :, :, :L], X0[:, :, :, :L])  # the x dt rows untouched
    first = Xk[:, :, 0, L:].transpose(-1, -2)
    assert torch.equal(first, state if with_state else torch.zeros_like(first))


def test_prefill_exp_is_std_exp_bit_for_bit():
    """The prefill kernels' exp (glibc's expf, 8 lanes at a time) against std::exp element by
    element: every 255th float32 bit pattern (both signs, all exponents: normal, denormal,
    overflowing, underflowing, inf, NaN), the values around the edges of glibc's fast range,
    and a tail shorter than a vector."""
    bits = torch.arange(-(1 << 31), 1 << 31, 255, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([88.0, -88.0, 88.72283, 88.72284, -87.33654, -103.27893, -103.97208,
                          -104.0, 0.0, -0.0, 1e-30, -1e-30, float("inf"), float("-inf"),
                          float("nan"), 2.0**-126, 0.5, -0.5, 1.0, 10.0, -10.0])
    edges = torch.cat([edges, torch.nextafter(edges, torch.tensor(float("inf"))),
                       torch.nextafter(edges, torch.tensor(float("-inf")))])
    for x in (bits.view(torch.float32), edges, edges[:7]):
        got, want = K.prefill_exp(x, True), K.prefill_exp(x, False)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert K.prefill_exp(torch.tensor([0.0, 1.0]), True).tolist() == [1.0, 2.7182817459106445]
