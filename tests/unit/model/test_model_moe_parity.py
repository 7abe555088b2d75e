"""Baton's NemotronH `E` (MoE) layers against transformers' NemotronHForCausalLM.

Two models: a Nano-like one (sigmoid router with a non-zero `e_score_correction_bias`, one
group) saved in the published layout (`backbone.`, one tensor per expert), and a Super-like
latent MoE with group top-k saved in transformers 5's fused layout (`model.`, [E, ...]).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from baton.model.layers.moe import sigmoid_group_topk  # noqa: E402
from baton.model.loader import load_model  # noqa: E402
from tests.support.hf_parity import (  # noqa: E402
    assert_batched_prefill_matches,
    assert_greedy_matches,
    assert_logits_match,
    prompt_ids,
    rescale,
)

pytestmark = pytest.mark.usefixtures("model_single_thread")

COMMON = dict(
    vocab_size=300, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
    chunk_size=64, moe_intermediate_size=48, moe_shared_expert_intermediate_size=80,
)
NANO = dict(
    hybrid_override_pattern="ME*E-E", hidden_size=64, n_routed_experts=16,
    num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True,
)
SUPER = dict(
    hybrid_override_pattern="EM*E", hidden_size=64, n_routed_experts=16,
    num_experts_per_tok=3, moe_latent_size=32, n_group=4, topk_group=2,
    routed_scaling_factor=5.0, norm_topk_prob=True,
)
GREEDY_LENGTHS = [1, 17, 300, 2048]
NEW_TOKENS = 12
TPB = 16


def _hf_model(fields: dict, seed: int):
    cfg = transformers.NemotronHConfig(**COMMON, **fields)
    torch.manual_seed(seed)
    hf = transformers.NemotronHForCausalLM(cfg).eval()
    rescale(hf, seed, dims=(2, 3))
    return hf


@pytest.fixture(scope="module")
def model_nano_pair(tmp_path_factory):
    """(HF, Baton) for the Nano-like model, through HF's save_pretrained (published layout)."""
    hf = _hf_model(NANO, seed=1)
    out = tmp_path_factory.mktemp("hf_nano")
    hf.save_pretrained(out)
    return hf, load_model(out), out


@pytest.fixture(scope="module")
def model_super_pair(tmp_path_factory):
    """(HF, Baton) for the Super-like model, written in transformers' in-memory naming."""
    hf = _hf_model(SUPER, seed=2)
    out = tmp_path_factory.mktemp("hf_super")
    hf.config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return hf, load_model(out), out


@pytest.fixture(params=["nano", "super"])
def model_moe_pair(request):
    return request.getfixturevalue(f"model_{request.param}_pair")


def test_checkpoint_layouts_are_the_ones_under_test(model_nano_pair, model_super_pair):
    with safe_open(str(model_nano_pair[2] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "backbone.layers.1.mixer.experts.15.up_proj.weight" in keys
    assert not any(k.startswith("model.") for k in keys)
    with safe_open(str(model_super_pair[2] / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mixer.experts.up_proj").get_shape() == [16, 48, 32]
        assert "model.layers.3.mixer.fc1_latent_proj.weight" in f.keys()
    # transformers writes the pattern as a list; Baton reads config.json as written
    d = json.loads((model_super_pair[2] / "config.json").read_text())
    assert model_super_pair[1].config.pattern == "EM*E" and "layers_block_type" in d


def _router_inputs(hf, ids) -> dict[int, torch.Tensor]:
    """The normed hidden states each HF `E` layer's router sees, by layer."""
    seen, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        if layer.block_type == "moe":
            hooks.append(layer.mixer.gate.register_forward_pre_hook(
                lambda m, a, i=i: seen.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        hf(ids[None])
    for h in hooks:
        h.remove()
    return seen


def _changed_fraction(gate, x, **override) -> float:
    """Share of tokens whose chosen expert set changes under `override` of the router."""
    c = gate.cfg
    kw = dict(top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
              norm=c.norm_topk_prob, scale=c.routed_scaling_factor)
    logits = torch.nn.functional.linear(x.float(), gate.weight)
    bias = override.pop("bias", gate.e_score_correction_bias)
    a = sigmoid_group_topk(logits, gate.e_score_correction_bias, **kw).experts.sort(-1)[0]
    b = sigmoid_group_topk(logits, bias, **{**kw, **override}).experts.sort(-1)[0]
    return (a != b).any(-1).float().mean().item()


def test_routing_bias_and_groups_change_the_chosen_experts(model_nano_pair, model_super_pair):
    for (hf, model, _), knob in ((model_nano_pair, "bias"), (model_super_pair, "groups")):
        for i, x in _router_inputs(hf, prompt_ids(200, seed=3)).items():
            gate = model.backbone.layers[i].mixer.gate
            if knob == "bias":
                assert gate.e_score_correction_bias.abs().min() > 0
                frac = _changed_fraction(gate, x, bias=torch.zeros_like(gate.e_score_correction_bias))
            else:
                frac = _changed_fraction(gate, x, topk_group=gate.cfg.n_group)
            assert frac > 0.2, f"layer {i}: the {knob} change only {frac:.0%} of the choices"


def test_prefill_logits_match_hf_at_every_position(model_moe_pair):
    hf, model, _ = model_moe_pair
    assert_logits_match(hf, model, prompt_ids(2048, seed=5), TPB)


def test_batched_prefill_matches_hf_batch(model_moe_pair):
    hf, model, _ = model_moe_pair
    ids = torch.stack([prompt_ids(160, seed=20 + i) for i in range(3)])
    assert_batched_prefill_matches(hf, model, ids, TPB)


def test_greedy_matches_hf_generate_with_batched_decode(model_moe_pair):
    hf, model, _ = model_moe_pair
    assert_greedy_matches(hf, model, GREEDY_LENGTHS, NEW_TOKENS, TPB)
