"""The MoE layers on the fast decode path (`moe.run_experts` on Baton's CPU kernel).

A token's MoE output must not depend on which other tokens are routed to its experts (the
speculative verify pass runs K+1 rows where plain decode ran one): NemotronH's `E` block (with
and without a latent width) and the Qwen MoE block, one token alone against the same token
inside a batch of 8 whose other tokens share its experts, bit for bit. Expert stacks stored
in float16 / bfloat16 (`model.weight_dtype`) go through the kernel too: the same bits as the
kernel on float32 stacks holding the same (upcast) values. The fast path stays within float32
rounding of the reference path, which is still torch.mm (and exact on the same inputs).
"""

from __future__ import annotations

import pytest
import torch

from baton.model.layers import cpu_kernels, linear
from baton.model.layers.moe import MoE, Routing, run_experts
from baton.model.layers.softmax_moe import SoftmaxMoE
from baton.model.nemotron_h.config import ModelConfig
from baton.model.nemotron_h.make import checkpoint_config

pytestmark = pytest.mark.skipif(cpu_kernels.gemv() is None, reason="cpu kernel not built")

HIDDEN = 64


class _QwenCfg:
    hidden_size, num_experts, num_experts_per_tok = HIDDEN, 8, 2
    moe_intermediate_size, shared_expert_intermediate_size = 40, 64
    hidden_act, norm_topk_prob = "silu", True


def _seeded(block: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return linear.install(block.eval())


def _block(kind: str) -> torch.nn.Module:
    if kind == "qwen":
        return _seeded(SoftmaxMoE(_QwenCfg(), renormalize=True))
    latent = {"moe_latent_size": 32} if kind == "nemotron_latent" else {}
    cfg = ModelConfig.from_dict(checkpoint_config(
        "tiny", pattern="E", hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=48, moe_shared_expert_intermediate_size=80, **latent))
    return _seeded(MoE(cfg))


def _tokens() -> torch.Tensor:
    """Token 0, then 7 tokens near it (so routed to many of its experts) or far from it."""
    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(1, HIDDEN, generator=gen)
    near = x0 + 0.05 * torch.randn(4, HIDDEN, generator=gen)
    return torch.cat([x0, near, torch.randn(3, HIDDEN, generator=gen)])


def _run(block, x: torch.Tensor, path: str) -> torch.Tensor:
    old = linear.set_decode_path(path)
    try:
        with torch.inference_mode(), linear.decode_scope():
            return block(x[:, None, :])[:, 0]  # [rows, 1 token, H] as a decode step has them
    finally:
        linear.set_decode_path(old)


def _experts(block, x: torch.Tensor) -> torch.Tensor:
    """[rows, k] the experts each row is routed to (the router as the block runs it)."""
    old = linear.set_decode_path("fast")
    try:
        with torch.inference_mode(), linear.decode_scope():
            if isinstance(block, SoftmaxMoE):
                return torch.topk(block.gate(x), block.top_k, dim=-1)[1]
            return block.gate(x).experts
    finally:
        linear.set_decode_path(old)


KINDS = ["nemotron", "nemotron_latent", "qwen"]


@pytest.mark.parametrize("kind", KINDS)
def test_token_alone_equals_token_in_a_batch_sharing_its_experts(kind):
    block, x = _block(kind), _tokens()
    chosen = _experts(block, x)
    shared = sum(len(set(chosen[0].tolist()) & set(chosen[i].tolist())) for i in range(1, 8))
    assert shared >= 4, f"only {shared} expert choices shared with token 0"
    alone = _run(block, x[:1], "fast")
    batch = _run(block, x, "fast")
    assert torch.equal(alone[0], batch[0])
    for i in range(1, 8):  # every row, not just the first
        assert torch.equal(_run(block, x[i:i + 1], "fast")[0], batch[i])


@pytest.mark.parametrize("kind", KINDS)
def test_fast_path_within_rounding_of_the_reference(kind):
    block, x = _block(kind), _tokens()
    ref, fast = _run(block, x, "reference"), _run(block, x, "fast")
    assert (ref - fast).abs().max().item() < 1e-5
    # the reference is torch.mm as before: a second block on the same weights agrees exactly
    assert torch.equal(_run(_block(kind), x, "reference"), ref)


def _stacks(block) -> list[torch.Tensor]:
    return [getattr(m, n) for m in block.modules() for n in getattr(m, "stacked", ())]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_half_expert_stacks_go_through_the_kernel(kind, dtype):
    half, x = _block(kind), _tokens()
    full = sum(t.numel() for t in _stacks(half))
    saved = linear.cast_weights(half, dtype)
    assert {t.dtype for t in _stacks(half)} == {dtype}
    linears = sum(m.weight.numel() for m in half.modules() if isinstance(m, torch.nn.Linear))
    assert saved == (full + linears) * 2
    # the same values in float32 stacks (and float32 linears): the kernel upcasts exactly
    same = _block(kind)
    same.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    got = _run(half, x, "fast")
    assert torch.equal(got, _run(same, x, "fast"))
    assert torch.equal(_run(half, x[:1], "fast")[0], got[0])
    ref = _run(half, x, "reference")  # torch.mm on each expert upcast
    assert (ref - got).abs().max().item() < 1e-5


def test_expert_parallel_shard_on_the_kernel():
    """A rank holding experts [first, first + held) adds exactly the held experts' terms: the
    full layer with the other experts' weights zeroed, bit for bit."""
    block, x = _block("nemotron"), _tokens()
    experts = block.experts
    first, held = 4, 6
    with torch.inference_mode(), linear.decode_scope():
        old = linear.set_decode_path("fast")
        try:
            routing = block.gate(x)
            got, counts = run_experts(x, routing, experts.up_proj[first:first + held],
                                      experts.down_proj[first:first + held], block.act,
                                      first, 16)
            mine = (routing.experts >= first) & (routing.experts < first + held)
            assert 0 < int(mine.sum()) < mine.numel()
            zeroed = Routing(routing.experts, routing.weights * mine)
            want, _ = run_experts(x, zeroed, experts.up_proj, experts.down_proj, block.act)
        finally:
            linear.set_decode_path(old)
    assert torch.equal(got, want)
    assert counts.tolist() == torch.bincount(routing.experts.flatten(), minlength=16).tolist()


@pytest.mark.parametrize("fields", [{"pattern": "M*EME"}, {"family": "qwen3_5_moe"}],
                         ids=["nemotron_h_moe", "qwen3_5_moe"])
def test_verify_rows_equal_plain_decode_with_moe_layers(fields, tmp_path):
    """A speculative verify pass on the fast path (4 sequences x 4 positions) is plain fast
    decode bit for bit through MoE layers too: logits and every position's state."""
    from baton.model.layers import step_kernels
    from baton.model.loader import load_model
    from baton.model.make_model import write_checkpoint
    from tests.unit.engine.speculative.test_speculative import (
        _assert_verify_equals_decode_bit_for_bit,
    )

    if step_kernels.kernels() is None:
        pytest.skip("step kernels not built")
    model = load_model(write_checkpoint(tmp_path / "m", seed=2, **fields))
    old = linear.set_decode_path("fast")
    try:
        _assert_verify_equals_decode_bit_for_bit(model)
    finally:
        linear.set_decode_path(old)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_fast_prefill_experts_are_the_one_thread_loop_at_any_thread_count(kind, threads):
    """A prefill's routed experts on the fast path (`step_kernels` `grouped_mm`: one expert a
    thread) give the bits of the reference path's torch.mm loop at one thread, also at 2
    threads (where the loop's MKL splits runs of 5-11 rows differently) and on an expert
    parallel shard."""
    from baton.model.layers import step_kernels

    if step_kernels.kernels() is None:
        pytest.skip("step kernels not built")
    block = _block(kind)
    experts = block.experts
    up, down = (getattr(experts, n) for n in experts.stacked)
    act = block._swiglu if kind == "qwen" else block.act
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(5))
    h = x if up.shape[-1] == HIDDEN else torch.randn(40, up.shape[-1])  # a latent width's input
    old, old_threads = linear.set_decode_path("reference"), torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            routing = (block.gate(x) if kind != "qwen"
                       else Routing(*reversed(torch.topk(block.gate(x).softmax(-1), 2))))
            want, counts = run_experts(h, routing, up, down, act)
            shard, _ = run_experts(h, routing, up[3:9], down[3:9], act, 3, up.shape[0])
            assert sorted(set(counts.tolist()) & set(range(5, 12))), counts  # MKL's odd sizes
            linear.set_decode_path("fast")
            torch.set_num_threads(threads)
            got, got_counts = run_experts(h, routing, up, down, act)
            got_shard, _ = run_experts(h, routing, up[3:9], down[3:9], act, 3, up.shape[0])
    finally:
        linear.set_decode_path(old)
        torch.set_num_threads(old_threads)
    assert torch.equal(got, want) and torch.equal(got_counts, counts)
    assert torch.equal(got_shard, shard)
