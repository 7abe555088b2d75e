"""`bench engine`'s roofline FLOP count: a MoE block's routed experts count for the top-k a
token is sent to (they are stacked parameters, not `nn.Linear`s, so the linear sum alone
left them out and the MoE families' prefill fractions read 0.33-0.49 instead of 0.57-0.66)."""

from __future__ import annotations

from torch import nn

from baton.model.layers.moe import MoE
from baton.model.layers.softmax_moe import SoftmaxMoE
from baton.model.nemotron_h.config import ModelConfig
from baton.model.nemotron_h.make import checkpoint_config
from bench.roofline import _routed_expert_flops


class _QwenCfg:
    hidden_size, hidden_act, norm_topk_prob = 64, "silu", True
    num_experts, num_experts_per_tok = 8, 2
    moe_intermediate_size, shared_expert_intermediate_size = 40, 48


def test_routed_experts_count_top_k_experts_per_token():
    cfg = ModelConfig.from_dict(checkpoint_config(
        "tiny", pattern="E", hidden_size=64, n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=48, moe_shared_expert_intermediate_size=80))
    model = nn.ModuleList([SoftmaxMoE(_QwenCfg(), renormalize=True), MoE(cfg),
                           nn.Linear(64, 64)])
    qwen = 2 * 2 * (2 * 40 * 64 + 64 * 40)  # 2 experts: gate_up [80, 64], down [64, 40]
    nemotron = 2 * 4 * (48 * 64 + 64 * 48)  # 4 experts: up [48, 64], down [64, 48]
    assert _routed_expert_flops(model) == qwen + nemotron
    assert _routed_expert_flops(nn.Sequential(nn.Linear(64, 64))) == 0


def test_each_moe_block_adds_its_routed_experts_to_the_step_matmuls():
    import pytest

    from baton.model.layers import cpu_kernels
    from bench.roofline import _expert_runs

    if cpu_kernels.gemv() is None:
        pytest.skip("cpu kernel not built")
    cfg = ModelConfig.from_dict(checkpoint_config(
        "tiny", pattern="E", hidden_size=64, n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=48, moe_shared_expert_intermediate_size=80))
    qwen, nemotron = SoftmaxMoE(_QwenCfg(), renormalize=True), MoE(cfg)
    runs = _expert_runs(nn.ModuleList([qwen, nemotron, nn.Linear(64, 64)]), batch=5)
    shapes = [tuple(tuple(y.shape) for y in run()) for run in runs]
    # batch x top-k pairs: Qwen's gate_up [80] then down [64]; NemotronH's up [48], down [64]
    assert shapes == [((10, 80), (10, 64)), ((20, 48), (20, 64))]
    assert _expert_runs(nn.Sequential(nn.Linear(64, 64)), batch=5) == []


def test_a_step_reads_every_linear_and_each_routed_expert_it_draws_once():
    """`step_over_read`'s bytes: every linear's weight as stored, and per MoE block the
    distinct experts `_expert_runs` sends the batch's tokens to (top-k a token; a big batch
    reaches every expert, each read once)."""
    import torch

    from bench.roofline import _expert_choice, _linears, weight_bytes

    cfg = ModelConfig.from_dict(checkpoint_config(
        "tiny", pattern="E", hidden_size=64, n_routed_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=48, moe_shared_expert_intermediate_size=80))
    qwen, nemotron = SoftmaxMoE(_QwenCfg(), renormalize=True), MoE(cfg)
    model = nn.ModuleList([qwen, nemotron, nn.Linear(64, 64)])
    linears = sum(m.weight.numel() * 4 for m in _linears(model))
    one_qwen, one_nemotron = (80 * 64 + 64 * 40) * 4, (48 * 64 + 64 * 48) * 4
    assert weight_bytes(model, 1) == linears + 2 * one_qwen + 4 * one_nemotron
    assert weight_bytes(model, 64) == linears + 8 * one_qwen + 16 * one_nemotron
    used = [len(torch.unique(_expert_choice(k, e, 3))) for k, e in ((2, 8), (4, 16))]
    assert weight_bytes(model, 3) == linears + used[0] * one_qwen + used[1] * one_nemotron
    model.half()
    assert weight_bytes(model, 64) == (linears + 8 * one_qwen + 16 * one_nemotron) // 2


def test_a_decode_step_streams_every_state_once_and_its_keys_and_values():
    """The bytes behind `floor_over_linear`: every state tensor of every state layer (conv
    window and SSM state for NemotronH's Mamba2) per sequence, and K and V of every attention
    layer per token of context."""
    from bench.roofline import step_stream_bytes

    cfg = ModelConfig.from_dict(checkpoint_config(
        "tiny", pattern="M*M-", hidden_size=64, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=2, conv_kernel=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16))
    conv = (4 * 16 + 2 * 2 * 8) * 3  # channels x (kernel - 1)
    ssm = 4 * 16 * 8  # heads x head_dim x state
    state, kv = step_stream_bytes(cfg, batch=3, context=10.5)
    assert state == 3 * 2 * (conv + ssm) * 4  # 3 sequences, 2 Mamba2 layers, float32
    assert kv == int(3 * 10.5 * 1 * 2 * 2 * 16 * 4)  # 1 attention layer: K and V, 2 heads


def test_side_by_side_alternates_whole_batch_steps_with_passes_and_frees_the_batch(model_tiny_dir):
    """The decode roofline's figure: every timed step decodes all of the batch (a request
    leaving would shrink the step under its pass), the ratio is of the pairs, and the batch is
    aborted after with every block and slot back, also when a request of it is refused."""
    import pytest

    from baton.errors import InvalidRequestError
    from bench.common import decode_engine, prompts
    from bench.roofline import side_by_side, weight_bytes

    eng = decode_engine(model_tiny_dir, 3, 64)
    blocks, slots = eng.cache.num_free_blocks, eng.cache.num_free_slots
    reqs = prompts(3, 20, eng.model.config.vocab_size, seed=3)
    got = side_by_side(eng, reqs, pairs=4, warm=1)
    assert set(got) == {"step_s", "linear_s", "ratio", "weight_mb", "step_gbps", "read_gbps",
                        "step_over_read"}
    assert got["step_s"] > 0 and got["linear_s"] > 0 and got["ratio"] > 0
    assert got["weight_mb"] == weight_bytes(eng.model, 3) / 1e6 > 0
    assert got["step_gbps"] > 0 and got["read_gbps"] > 0 and got["step_over_read"] > 0
    assert not eng.has_work and not eng.requests
    assert (eng.cache.num_free_blocks, eng.cache.num_free_slots) == (blocks, slots)
    got = side_by_side(eng, reqs, pairs=2, warm=0)  # the same ids again: nothing left behind
    assert not eng.has_work
    with pytest.raises(InvalidRequestError, match="max model length"):  # the second cannot fit
        side_by_side(eng, [reqs[0], reqs[1] * 10], pairs=2, warm=0)
    assert not eng.has_work and not eng.requests  # the first was aborted with it
    assert (eng.cache.num_free_blocks, eng.cache.num_free_slots) == (blocks, slots)
