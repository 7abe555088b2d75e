"""The softmax-routed MoE feed-forward (`SoftmaxMoE`) against transformers' Qwen3_5MoeSparseMoeBlock and
Qwen3NextSparseMoeBlock (same weights, same input), and the per-expert checkpoint layout
(`experts.{e}.gate_proj` / `up_proj` / `down_proj`) stacked into its fused parameters."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from baton.model.layers.softmax_moe import SoftmaxMoE  # noqa: E402
from baton.model.qwen3_5.moe_config import is_sparse_layer  # noqa: E402
from baton.model.stacking import ExpertStacks  # noqa: E402

SHAPE = dict(hidden_size=48, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=20,
             shared_expert_intermediate_size=36, hidden_act="silu")


def _pair(kind: str, **extra):
    if kind == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

        cfg = transformers.Qwen3_5MoeTextConfig(**SHAPE, **extra)
        hf, ours = m.Qwen3_5MoeSparseMoeBlock(cfg), SoftmaxMoE(cfg, renormalize=True)
    else:
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        cfg = transformers.Qwen3NextConfig(**SHAPE, **extra)
        hf, ours = m.Qwen3NextSparseMoeBlock(cfg), SoftmaxMoE(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf.eval(), ours.eval(), cfg


@pytest.mark.parametrize("kind,extra", [
    ("qwen3_5_moe", {}),
    ("qwen3_next", {"norm_topk_prob": True}),
    ("qwen3_next", {"norm_topk_prob": False}),
])
def test_block_matches_transformers(kind, extra):
    hf, ours, cfg = _pair(kind, **extra)
    x = torch.randn(3, 70, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(x), ours(x)
    assert (got - ref).abs().max().item() < 1e-5
    assert ours.routed_tokens.sum().item() == 3 * 70 * 3
    # the routing weights really are (or are not) renormalised: outputs differ across the two
    if kind == "qwen3_next":
        other = SoftmaxMoE(cfg, renormalize=not cfg.norm_topk_prob)
        other.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (other(x) - got).abs().max().item() > 1e-3


def test_sparse_layers_follow_step_and_mlp_only_layers():
    cfg = transformers.Qwen3NextConfig(**SHAPE, num_hidden_layers=6, decoder_sparse_step=2,
                                       mlp_only_layers=[3])
    assert [i for i in range(6) if is_sparse_layer(cfg, i)] == [1, 5]
    dense = transformers.Qwen3_5MoeTextConfig(**SHAPE)
    assert all(is_sparse_layer(dense, i) for i in range(4))


def test_per_expert_tensors_stack_into_gate_up_proj(tmp_path):
    hf, ours, _ = _pair("qwen3_5_moe")
    gate_up, down = ours.experts.gate_up_proj.detach(), ours.experts.down_proj.detach()
    width = gate_up.shape[1] // 2
    tensors = {}
    for e in range(12):
        pre = f"model.layers.0.mlp.experts.{e}"
        tensors[f"{pre}.gate_proj.weight"] = gate_up[e, :width].clone()
        tensors[f"{pre}.up_proj.weight"] = gate_up[e, width:].clone()
        tensors[f"{pre}.down_proj.weight"] = down[e].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    expected = {"model.layers.0.mlp.experts.gate_up_proj": gate_up,
                "model.layers.0.mlp.experts.down_proj": down}
    stacks = ExpertStacks(expected)
    for name in tensors:
        assert stacks.claim(name, name, tmp_path / "model.safetensors")
    state = {}
    stacks.load(state, torch.device("cpu"), torch.float32)
    assert torch.equal(state["model.layers.0.mlp.experts.gate_up_proj"], gate_up)
    assert torch.equal(state["model.layers.0.mlp.experts.down_proj"], down)
