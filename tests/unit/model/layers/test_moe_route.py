"""`qwen_moe`'s glue as plain loops (cpu_kernels/gemv_route.h) against the ATen ops it
replaces, bit for bit.

At batch 1 the router's softmax / top-k / renormalising sum, SwiGLU's silu and the shared
expert's sigmoid gate ran as ~20 ATen calls a MoE layer, ~0.1 ms with the caches cold after a
weight stream. The replicas follow torch's AVX-512 kernels (Sleef's exp, the reduction orders,
top-k's selection and tie order), so they are checked against torch itself: the router at
expert counts below, at and above a vector, every k from 1 to 15, logits from flat to peaked,
with ties; SwiGLU at widths with and without a tail; and the whole block against the module
(`SoftmaxMoE`, the path plain decode and a speculative verify share) at 1 and 2 threads,
float32 and float16 weights, silu calls small enough for one thread and large enough for torch
to split over its threads (mid-row too), and a size where the replicas do not apply (16 weights
to renormalise): outputs and the expert load counts equal. NemotronH's
block (sigmoid scores, bias-steered unsorted top-k, relu2 experts) the same way, where torch
runs its AVX2 kernels too (its replicas use none of AVX-512's).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.model.layers import cpu_kernels, linear, step_kernels
from baton.model.layers.fast_blocks import mlp_part, program
from baton.model.layers.moe import MoE, sigmoid_group_topk
from baton.model.layers.softmax_moe import SoftmaxMoE
from baton.model.nemotron_h.config import ModelConfig
from baton.model.nemotron_h.make import checkpoint_config

g = cpu_kernels.gemv()
qwen_route = pytest.mark.skipif(g is None or not g.route_available(),
                                reason="kernels not built, or torch is on neither AVX2 nor "
                                       "AVX-512 here")
sigmoid_route = pytest.mark.skipif(g is None or not g.route_sigmoid_available(),
                                   reason="kernels not built, or torch is on neither AVX2 "
                                          "nor AVX-512 here")
runner = pytest.mark.skipif(step_kernels.kernels() is None,
                            reason="step kernels (the layer runner) not built")


def _router(logits: torch.Tensor, k: int, norm: bool):
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    w, e = torch.topk(probs, k, dim=-1)
    return (w / w.sum(dim=-1, keepdim=True) if norm else w), e


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


@qwen_route
@pytest.mark.parametrize("experts", [3, 8, 16, 17, 64, 256])
def test_router_is_torchs(experts):
    gen = torch.Generator().manual_seed(experts)
    checked = 0
    for rows in (1, 33):
        for scale in (0.01, 1.0, 30.0):
            logits = (torch.randn(rows, experts + 3, generator=gen) * scale)[:, :experts]
            for k in range(1, min(15, experts) + 1):
                for norm in (True, False):
                    want_w, want_e = _router(logits, k, norm)
                    got_w, got_e = g.route_replica(logits.contiguous(), k, norm)
                    assert torch.equal(got_e, want_e), (rows, scale, k, norm)
                    assert _same_bits(got_w, want_w), (rows, scale, k, norm)
                    checked += 1
    assert checked == 2 * 3 * 2 * min(15, experts)


@qwen_route
def test_router_ties_rank_as_torchs():
    logits = torch.tensor([[0.0] * 8, [1, 1, 0, 0, 1, 1, 0, 0], [0, 2, 2, 2, 2, 2, 2, 0],
                           [-1e30, 5, 5, -1e30, 0, 0, 0, 0]])
    for k in (1, 2, 3, 5):
        want_w, want_e = _router(logits, k, True)
        got_w, got_e = g.route_replica(logits, k, True)
        assert torch.equal(got_e, want_e) and _same_bits(got_w, want_w), k


@sigmoid_route
@pytest.mark.parametrize("experts", [16, 64, 128])
def test_sigmoid_router_is_torchs(experts):
    """NemotronH's router as `sigmoid_group_topk` runs it on the fast path (every group kept),
    with logits near -47 in some rows: scores ~1e-20, where the sum's 1e-20 counts."""
    gen = torch.Generator().manual_seed(experts)
    logits = torch.cat([torch.randn(20, experts, generator=gen) * 3,
                        torch.randn(4, experts, generator=gen) - 47])
    bias = torch.randn(experts, generator=gen) * 0.1
    old = linear.set_decode_path("fast")
    try:
        with torch.inference_mode(), linear.decode_scope():
            for k in range(1, 16):
                for norm in (True, False):
                    want = sigmoid_group_topk(logits, bias, top_k=k, n_group=1, topk_group=1,
                                              norm=norm, scale=2.5)
                    w, e = g.route_sigmoid_replica(logits, bias, k, norm, 2.5)
                    assert torch.equal(e, want.experts), (k, norm)
                    assert _same_bits(w, want.weights), (k, norm)
    finally:
        linear.set_decode_path(old)


@qwen_route
@pytest.mark.parametrize("width", [640, 48, 47, 17, 1])
@pytest.mark.parametrize("rows", [1, 5])
def test_swiglu_is_torchs(width, rows):
    gu = torch.randn(rows, 2 * width + 5, generator=torch.Generator().manual_seed(width))
    gu = (gu * 6)[:, : 2 * width]  # rows a stride apart, as the kernel's outputs are read
    assert _same_bits(g.swiglu_replica(gu.contiguous()), F.silu(gu[:, :width]) * gu[:, width:])


def _vector_and_scalar_disagree(n: int) -> torch.Tensor:
    """n values whose silu on torch's vector path and on its scalar path (a strided view's
    loop) round apart: ~4% of inputs; a piece of a row taken the wrong way shows in every
    element it holds."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1)) * 6
    spaced = x.new_empty(2 * x.numel())[::2]
    spaced.copy_(x)
    picked = x[F.silu(x) != F.silu(spaced)]
    return picked.repeat(n // picked.numel() + 1)[:n]


@qwen_route
@pytest.mark.parametrize("width, rows, threads", [
    (44, 745, 2),  # 32,780 elements: 2 pieces, cut at element 22 of row 372
    (40, 2005, 3),  # 80,200: 3 pieces, cut at 14 of row 668 and 28 of row 1,336
    (40, 819, 2),  # 32,760: under the grain, one thread
])
def test_swiglu_split_over_threads_is_torchs(width, rows, threads):
    gu = torch.empty(rows, 2 * width + 3)[:, : 2 * width]
    gu[:, :width] = _vector_and_scalar_disagree(rows * width).view(rows, width)
    gu[:, width:] = torch.randn(rows, width, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = F.silu(gu[:, :width]) * gu[:, width:]
        assert _same_bits(g.swiglu_replica(gu.contiguous()), want)
    finally:
        torch.set_num_threads(before)


class _Cfg:
    hidden_size, hidden_act, norm_topk_prob = 64, "silu", True

    def __init__(self, experts: int, k: int, width: int, shared: int):
        self.num_experts, self.num_experts_per_tok = experts, k
        self.moe_intermediate_size, self.shared_expert_intermediate_size = width, shared


def _block(cfg: _Cfg, dtype: torch.dtype) -> SoftmaxMoE:
    block = SoftmaxMoE(cfg, renormalize=True)
    gen = torch.Generator().manual_seed(cfg.num_experts)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    linear.install(block.eval())
    if dtype != torch.float32:
        linear.cast_weights(block, dtype)
    return block


def _run(block, rows: int, threads: int):
    """(the fast path's direct call, the module's h + block(x), the load counted by the first)."""
    body = mlp_part(block)
    assert body is not None  # the block's kernel call (the layer runner's), not its module
    prog = program([(torch.ones(64), 1e-6, body)])  # the norm is not run: `body` takes x

    def run(x, h):
        return prog.body(0, x, h)
    gen = torch.Generator().manual_seed(rows)
    x, h = torch.randn(rows, 64, generator=gen), torch.randn(rows, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    old = linear.set_decode_path("fast")
    try:
        with torch.inference_mode(), linear.decode_scope():
            got = run(x, h)
            load = block.routed_tokens.clone()
            return got, h + block(x[:, None, :])[:, 0], load
    finally:
        linear.set_decode_path(old)
        torch.set_num_threads(before)


# (experts, k, expert width, shared width, rows, threads, whether the replicas apply). Past
# 32,768 elements torch splits a silu call over its threads, and each thread's piece of a row
# has its own vector body and scalar tail: the expert call split at a row's start (640 x 64
# pairs, 40 x 1,200), both calls mid-row (40 x 903 at element 20 of a row, 136 x 301 at 68),
# in 3 pieces (40 x 2,005 at 14 and 28); 16 weights to renormalise: the module's ATen ops.
CASES = [(8, 2, 40, 64, 1, 2, True), (8, 2, 40, 64, 8, 2, True), (8, 2, 40, 64, 40, 1, True),
         (64, 8, 48, 32, 3, 2, True), (32, 10, 16, 16, 5, 2, True),
         (8, 2, 640, 64, 32, 2, True), (8, 2, 40, 64, 600, 2, True),
         (8, 3, 40, 136, 301, 2, True), (8, 5, 40, 64, 401, 3, True),
         (32, 16, 16, 16, 3, 2, False)]


@qwen_route
@runner
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", CASES, ids=[f"E{c[0]}k{c[1]}w{c[2]}-m{c[4]}-t{c[5]}"
                                             for c in CASES])
def test_block_equals_the_module(case, dtype):
    experts, k, width, shared, rows, threads, applies = case
    block = _block(_Cfg(experts, k, width, shared), dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert g.route_applies(rows, k, width, shared) is applies
    finally:
        torch.set_num_threads(before)
    got, want, load = _run(block, rows, threads)
    assert _same_bits(got, want)
    assert int(load.sum()) == rows * k
    assert torch.equal(block.routed_tokens, 2 * load)  # the module counted the same tokens


# (experts, k, rows, threads): top-k by nth_element (k * 64 > E) and by partial_sort
NEMOTRON = [(16, 4, 1, 2), (16, 4, 9, 2), (64, 6, 5, 1), (128, 2, 3, 2), (32, 10, 40, 2)]


@sigmoid_route
@runner
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", NEMOTRON, ids=[f"E{c[0]}k{c[1]}-m{c[2]}-t{c[3]}"
                                                for c in NEMOTRON])
def test_nemotron_block_equals_the_module(case, dtype):
    experts, k, rows, threads = case
    cfg = ModelConfig.from_dict(checkpoint_config(
        "tiny", pattern="E", hidden_size=64, n_routed_experts=experts, num_experts_per_tok=k,
        moe_intermediate_size=48, moe_shared_expert_intermediate_size=80))
    block = MoE(cfg)
    gen = torch.Generator().manual_seed(experts + k)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        block.gate.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.1)
    linear.install(block.eval())
    if dtype != torch.float32:
        linear.cast_weights(block, dtype)
    got, want, load = _run(block, rows, threads)
    assert _same_bits(got, want)
    assert int(load.sum()) == rows * k
    assert torch.equal(block.routed_tokens, 2 * load)
