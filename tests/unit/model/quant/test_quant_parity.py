"""Quantized checkpoints in every published layout load exactly: both families, dense and MoE,
written from one seeded float checkpoint each (bench/quant_layouts.py), against
transformers run on a float32 copy made by an independent dequantizer (compressed-tensors'
modules decompressed by the package itself), and Qwen FP8 against transformers' own FP8 loader
where every tile is whole. Logits at every position within 1e-4, greedy tokens identical.

The MoE models' expert width (80) is not a multiple of 128: their FP8 tiles are partial at
the edge, where transformers' loader infers a wrong tile size, so they are checked against the
independent dequantizer only.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("compressed_tensors")

from baton.model.loader import load_model  # noqa: E402
from baton.model.make_model import write_checkpoint  # noqa: E402
from baton.model.quant import open_checkpoint  # noqa: E402
from bench import quant_layouts  # noqa: E402
from tests.support.hf_parity import assert_greedy_matches, assert_logits_match, prompt_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("model_single_thread")

QWEN = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16)
NEMOTRON = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, mamba_num_heads=8, mamba_head_dim=16,
                ssm_state_size=16, n_groups=2, chunk_size=32)
MODELS = {
    "nemotron_h": dict(pattern="M*M-", **NEMOTRON),
    "nemotron_h_moe": dict(pattern="M*ME", moe_intermediate_size=80,
                           moe_shared_expert_intermediate_size=128, **NEMOTRON),
    "qwen3_5": dict(family="qwen3_5", pattern="GG*G", **QWEN),
    "qwen3_5_moe": dict(family="qwen3_5_moe", pattern="G*G", num_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=80,
                        shared_expert_intermediate_size=128, **QWEN),
    # Qwen3-Next's published layout: fused in_proj_qkvz (FP8, split at load), in_proj_ba kept
    "qwen3_next": dict(family="qwen3_next", pattern="G*G", num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=80, shared_expert_intermediate_size=128, **QWEN),
}
ONLY = {"qwen3_next": ("qwen_fp8", "ct_w4a16")}
"""The layouts published for a model (others: every layout)."""
WHOLE_TILES = ("qwen3_5",)  # NemotronH's Mamba in_proj has 328 rows: a partial tile
TPB = 16


@pytest.fixture(scope="module", params=sorted(MODELS))
def float_checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    return request.param, write_checkpoint(out / "float", seed=7, **MODELS[request.param])


@pytest.mark.parametrize("layout", quant_layouts.LAYOUTS)
def test_layout_loads_exactly(float_checkpoint, layout, tmp_path):
    name, src = float_checkpoint
    if layout not in ONLY.get(name, quant_layouts.LAYOUTS):
        pytest.skip(f"{name} is not published as {layout}")
    q = quant_layouts.write(src, tmp_path / layout, layout)
    ckpt = open_checkpoint(q)
    assert ckpt.entries, "the layout quantized nothing"
    if layout == "modelopt_mixed" and name.endswith("moe"):
        kinds = {e.rule.kind for e in ckpt.entries.values()}
        assert kinds == {"nvfp4", "fp8_tensor"}, kinds
    model = load_model(q)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        quant_layouts.dequantized_copy(q, tmp_path / "f32"), dtype=torch.float32).eval()
    assert_logits_match(ref, model, prompt_ids(37, seed=1), TPB)
    assert_greedy_matches(ref, model, [5, 33], new_tokens=6, tpb=TPB)
    if layout == "qwen_fp8" and name in WHOLE_TILES:
        # transformers' own FP8 loader (it dequantizes on CPU) reads the quantized folder
        hf = transformers.AutoModelForCausalLM.from_pretrained(q, dtype=torch.float32).eval()
        assert_logits_match(hf, model, prompt_ids(37, seed=2), TPB)


def test_compressed_tensors_nvfp4_rounds_to_the_packages_decompression(tmp_path):
    # the package decompresses NVFP4 in bfloat16; Baton decodes the same definition,
    # e2m1 * (scale / global_scale), in float32: rounded to bfloat16 they are the same bits
    import json

    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    src = write_checkpoint(tmp_path / "f", seed=7, **MODELS["qwen3_5_moe"])
    q = quant_layouts.write(src, tmp_path / "q", "ct_nvfp4")
    qc = json.loads((q / "config.json").read_text())["quantization_config"]
    g = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=g["targets"], weights=g["weights"])
    stored = load_file(str(q / "model.safetensors"))
    ckpt = open_checkpoint(q)
    assert {e.rule.kind for e in ckpt.entries.values()} == {"ct_nvfp4"}
    with ckpt.view(next(iter(ckpt.meta.values())).file) as f:
        for name in ckpt.entries:
            module = name.rpartition(".")[0]
            sd = {k.rpartition(".")[2]: v for k, v in stored.items()
                  if k.rpartition(".")[0] == module}
            theirs = BaseCompressor.get_value_from_registry(qc["format"]).decompress(
                sd, scheme)["weight"]
            assert theirs.dtype == torch.bfloat16
            assert torch.equal(f.get_tensor(name).to(torch.bfloat16), theirs), name
