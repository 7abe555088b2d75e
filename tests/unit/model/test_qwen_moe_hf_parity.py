"""Baton's Qwen3.5-MoE and Qwen3-Next against transformers (`AutoModelForCausalLM` on the
checkpoints Baton writes): prefill logits at every position up to 2048 tokens, batched
prefill, greedy tokens with batched decode.

Qwen3.5-MoE in the multimodal layout (fused experts under `model.language_model.`); Qwen3-Next
mixing MoE and dense layers (decoder_sparse_step 2 and an `mlp_only_layers` entry), routing
weights not renormalised, in its published layout (per-expert tensors, interleaved DeltaNet
projections).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from baton.model.layers.softmax_moe import SoftmaxMoE  # noqa: E402
from baton.model.loader import load_model  # noqa: E402
from baton.model.make_model import write_checkpoint  # noqa: E402
from baton.worker.load import expert_load  # noqa: E402
from tests.support.hf_parity import (  # noqa: E402
    assert_batched_prefill_matches,
    assert_greedy_matches,
    assert_logits_match,
    prompt_ids,
)

pytestmark = pytest.mark.usefixtures("model_single_thread")

SHAPE = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
    shared_expert_intermediate_size=56,
)
CONFIGS = {
    "qwen3_5_moe": dict(family="qwen3_5_moe", multimodal=True, pattern="GG*G*G"),
    "qwen3_next": dict(family="qwen3_next", pattern="GG*GG*", decoder_sparse_step=2,
                       mlp_only_layers=[3], norm_topk_prob=False),
}
ARCH = {"qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}
GREEDY_LENGTHS = [1, 63, 65, 300, 2048]
NEW_TOKENS = 12
TPB = 16


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def qwen_moe_pair(request, tmp_path_factory):
    fields = {**SHAPE, **CONFIGS[request.param]}
    out = write_checkpoint(tmp_path_factory.mktemp(request.param), seed=5, **fields)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == ARCH[request.param]
    hf.generation_config.eos_token_id = None
    return request.param, hf, load_model(out), out


def test_layouts_and_layer_kinds(qwen_moe_pair):
    family, _, model, out = qwen_moe_pair
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    if family == "qwen3_5_moe":
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in keys
        assert kinds == ["SoftmaxMoE"] * 6
    else:
        assert "model.layers.1.mlp.experts.7.gate_proj.weight" in keys
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in keys
        assert model.config.moe_layers == (1, 5)  # layer 3 is in mlp_only_layers
        assert kinds == ["GatedMLP", "SoftmaxMoE", "GatedMLP", "GatedMLP", "GatedMLP",
                         "SoftmaxMoE"]
        assert not model.model.layers[1].mlp.norm


def test_prefill_logits_match_hf_at_every_position(qwen_moe_pair):
    _, hf, model, _ = qwen_moe_pair
    assert_logits_match(hf, model, prompt_ids(2048, seed=5), TPB)
    moe = [m for m in model.modules() if isinstance(m, SoftmaxMoE)]
    assert all(m.routed_tokens.sum().item() >= 2048 * 3 for m in moe)
    load = expert_load(SimpleNamespace(model=model))  # what the worker's Stats report
    assert sorted(load) == list(model.config.moe_layers)
    assert all(sum(c) == moe[0].routed_tokens.sum().item() for c in load.values())


def test_batched_prefill_matches_hf_batch(qwen_moe_pair):
    _, hf, model, _ = qwen_moe_pair
    ids = torch.stack([prompt_ids(150, seed=20 + i) for i in range(3)])
    assert_batched_prefill_matches(hf, model, ids, TPB)


def test_greedy_matches_hf_generate_with_batched_decode(qwen_moe_pair):
    _, hf, model, _ = qwen_moe_pair
    assert_greedy_matches(hf, model, GREEDY_LENGTHS, NEW_TOKENS, TPB)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_make_model_cli_writes_the_moe_families(tmp_path, family):
    from baton.cli import main

    argv = ["make-model", "--out", str(tmp_path), "--family", family, "--moe-experts", "4",
            "--moe-top-k", "2", "--pattern", "G*G*"]
    assert main(argv) == 0
    model = load_model(tmp_path)
    cfg = model.config
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok) == (family, 4, 2)
    assert model.model.layers[3].mlp.experts.gate_up_proj.shape == (4, 256, 128)
