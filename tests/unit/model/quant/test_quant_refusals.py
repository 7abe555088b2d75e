"""A quantized checkpoint Baton cannot decode exactly is refused before any weight is read, in
one line naming the tensor (or setting), its shape or value, and the limit; a tensor-parallel
rank reads its rows / columns of a quantized weight with the matching scales, bit-equal to the
same shard of the dequantized checkpoint, and a shard that would cut a scale block is refused
naming the sizes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.errors import ConfigError
from baton.model.layers.parallel import TPGroup
from baton.model.loader import load_model
from baton.model.make_model import write_checkpoint
from baton.model.quant import open_checkpoint, packed, weight_format
from baton.model.tp_loader import load_tp_model
from bench import quant_layouts

QWEN = dict(family="qwen3_5", pattern="G*", vocab_size=300, hidden_size=128,
            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16)
NH_MOE = dict(pattern="M*E", vocab_size=300, hidden_size=128, intermediate_size=256,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, mamba_num_heads=8,
              mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=32,
              moe_intermediate_size=64, moe_shared_expert_intermediate_size=128)
W = "model.layers.0.mlp.up_proj"


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("qref")
    return {"qwen": write_checkpoint(root / "qwen", seed=1, **QWEN),
            "nh_moe": write_checkpoint(root / "nh_moe", seed=2, **NH_MOE)}


def _edit(d, config=None, drop=(), tensors=None, hf_quant=None):
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if drop or tensors:
        state = load_file(str(d / "model.safetensors"))
        for k in drop:
            del state[k]
        state.update(tensors or {})
        save_file(state, str(d / "model.safetensors"))
    if hf_quant is not None:
        h = json.loads((d / "hf_quant_config.json").read_text())
        hf_quant(h["quantization"])
        (d / "hf_quant_config.json").write_text(json.dumps(h))
    return d


def _refused(d, *words):
    with pytest.raises(ConfigError) as e:
        load_model(d)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


def test_unquantized_checkpoint_has_no_format(src):
    assert weight_format(src["qwen"]) is None
    assert open_checkpoint(src["qwen"]).entries == {}


def test_formats_are_named(src, tmp_path):
    want = {"qwen_fp8": "fp8_block128x128", "modelopt_fp8": "fp8", "modelopt_nvfp4": "nvfp4",
            "modelopt_mixed": "mixed_fp8_nvfp4", "ct_fp8": "fp8_channel",
            "ct_w4a16": "w4a16_g16", "ct_w4a16_asym": "w4a16_g16_asym", "ct_nvfp4": "nvfp4_ct"}
    for layout, label in want.items():
        assert weight_format(quant_layouts.write(src["qwen"], tmp_path / layout, layout)) == label


def test_fp8_bytes_without_quantization_config_are_refused(src, tmp_path):
    # the failure this issue began with: fp8 bytes cast as they are, scales dropped
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "qwen_fp8")
    _edit(d, config=lambda c: c.pop("quantization_config"))
    _refused(d, "F8_E4M3 [", "declares no quantization_config", "never casts")


def test_unknown_method_is_refused(src, tmp_path):
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "qwen_fp8")
    _edit(d, config=lambda c: c["quantization_config"].update(quant_method="gptq"))
    _refused(d, "quant_method 'gptq'", "'fp8', 'modelopt', 'compressed-tensors'")


def test_unknown_modelopt_algo_is_refused(src, tmp_path):
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "modelopt_fp8")
    _edit(d, hf_quant=lambda q: q.update(quant_algo="W4A8_AWQ"))
    _refused(d, "quant_algo 'W4A8_AWQ'", "NVFP4")


def test_missing_scale_is_refused(src, tmp_path):
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "qwen_fp8")
    _edit(d, drop=[f"{W}.weight_scale_inv"])
    _refused(d, f"{W}.weight", "no 'weight_scale_inv'", "never cast")
    d = quant_layouts.write(src["qwen"], tmp_path / "n", "modelopt_nvfp4")
    _edit(d, drop=[f"{W}.weight_scale_2"])
    _refused(d, f"{W}.weight", "U8 [256, 64]", "no 'weight_scale_2'")


def test_compressed_tensors_nvfp4_without_its_global_scale_is_refused(src, tmp_path):
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "ct_nvfp4")
    _edit(d, drop=[f"{W}.weight_global_scale"])
    _refused(d, f"{W}.weight_packed", "U8 [256, 64]", "no 'weight_global_scale'")
    d = quant_layouts.write(src["qwen"], tmp_path / "g", "ct_nvfp4")

    def group32(c):
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    _edit(d, config=group32)
    _refused(d, "group_size 32", "nvfp4-pack-quantized, tensor_group, group_size 16")


def test_misshaped_scale_is_refused(src, tmp_path):
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "qwen_fp8")
    _edit(d, tensors={f"{W}.weight_scale_inv": torch.ones(4, 2, dtype=torch.bfloat16)})
    _refused(d, f"{W}.weight_scale_inv", "[4, 2]", "[2, 1]")


def test_block_size_that_does_not_tile_is_refused(src, tmp_path):
    # scales written for 128 x 128 tiles, the config says 64 x 64
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "qwen_fp8")
    _edit(d, config=lambda c: c["quantization_config"].update(weight_block_size=[64, 64]))
    _refused(d, "weight_scale_inv", "fp8_block64x64 needs")
    _edit(d, config=lambda c: c["quantization_config"].update(weight_block_size=[128]))
    _refused(d, "weight_block_size [128]", "two positive integers")


def test_nvfp4_width_not_a_multiple_of_16_is_refused(src, tmp_path):
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "modelopt_nvfp4")
    state = load_file(str(d / "model.safetensors"))
    _edit(d, tensors={f"{W}.weight": state[f"{W}.weight"][:, :60].contiguous()})
    _refused(d, f"{W}.weight", "(120)", "multiple of 16")


def test_quantized_tensor_in_an_excluded_module_is_refused(src, tmp_path):
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "qwen_fp8")
    _edit(d, config=lambda c: c["quantization_config"]["modules_to_not_convert"].append(W))
    _refused(d, f"{W}.weight", "leaves module", "unquantized")


def test_scale_on_a_float_tensor_is_refused(src, tmp_path):
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "qwen_fp8")
    _edit(d, tensors={"lm_head.weight_scale_inv": torch.ones(3, 1)})
    _refused(d, "lm_head.weight_scale_inv", "not quantized")


def test_format_mismatching_the_per_layer_map_is_refused(src, tmp_path):
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "modelopt_mixed")
    _edit(d, hf_quant=lambda q: q["quantized_layers"][W].update(quant_algo="NVFP4"))
    _refused(d, f"{W}.weight", "F8_E4M3", "declares nvfp4")


def test_refusal_reads_no_weight(src, tmp_path, monkeypatch):
    # checked whole first: a bad tensor late in the file stops the load before any weight
    from baton.model.quant import checkpoint as ckpt_mod

    d = quant_layouts.write(src["qwen"], tmp_path / "q", "qwen_fp8")
    _edit(d, drop=["model.layers.1.mlp.down_proj.weight_scale_inv"])
    monkeypatch.setattr(ckpt_mod.FileView, "get_tensor", lambda *a: pytest.fail("read"))
    _refused(d, "model.layers.1.mlp.down_proj.weight")


LAYOUTS_TP = [("qwen", "qwen_fp8", (16, 16)), ("qwen", "modelopt_nvfp4", None),
              ("qwen", "ct_w4a16_asym", None), ("nh_moe", "modelopt_mixed", None),
              ("nh_moe", "qwen_fp8", (32, 32)), ("qwen", "ct_nvfp4", None)]


@pytest.mark.parametrize("model,layout,block", LAYOUTS_TP)
def test_tp_ranks_read_their_shard_of_the_scales(src, tmp_path, model, layout, block):
    q = quant_layouts.write(src[model], tmp_path / "q", layout, **({"block": block} if block
                                                                    else {}))
    ref = quant_layouts.dequantized_copy(q, tmp_path / "f32")
    for rank in range(2):
        ours = load_tp_model(q, TPGroup(rank, 2)).state_dict()
        want = load_tp_model(ref, TPGroup(rank, 2)).state_dict()
        assert ours.keys() == want.keys()
        for k in ours:  # weights kept packed (NVFP4, ModelOpt FP8): their decoded bits
            assert torch.equal(packed.dense(ours[k]), want[k]), k


def test_tp_shard_that_cuts_a_block_is_refused(src, tmp_path):
    q = quant_layouts.write(src["qwen"], tmp_path / "q", "qwen_fp8")  # 128 x 128 tiles
    with pytest.raises(ConfigError) as e:
        load_tp_model(q, TPGroup(0, 2))
    msg = str(e.value)
    assert "cuts its scale blocks of 128" in msg and "\n" not in msg, msg
    assert msg.startswith("tensor_parallel_size=2: "), msg
    # DeltaNet's in_proj_qkv [128, 128] is three sections (q 32, k 32, v 64 rows): rank 0's
    # part of q is rows [0:16]
    assert "in_proj_qkv.weight' [128, 128]: the part [0:16] of its rows" in msg, msg


def test_sharded_checkpoint_with_scales_in_another_file(src, tmp_path):
    # a weight and its scale in different shards of a multi-file checkpoint
    d = quant_layouts.write(src["qwen"], tmp_path / "q", "qwen_fp8")
    state = load_file(str(d / "model.safetensors"))
    a = {k: v for k, v in state.items() if not k.endswith("weight_scale_inv")}
    b = {k: v for k, v in state.items() if k.endswith("weight_scale_inv")}
    (d / "model.safetensors").unlink()
    save_file(a, str(d / "model-00001-of-00002.safetensors"))
    save_file(b, str(d / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {k: "model-00001-of-00002.safetensors" for k in a}
             | {k: "model-00002-of-00002.safetensors" for k in b}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    one = tmp_path / "one"
    shutil.copytree(d, one)
    got = load_model(d).state_dict()
    want = load_model(quant_layouts.dequantized_copy(
        quant_layouts.write(src["qwen"], tmp_path / "q1", "qwen_fp8"), tmp_path / "f")
    ).state_dict()
    for k in want:  # fp8 weights stay packed as stored: each decodes to the float32 bits
        assert torch.equal(packed.dense(got[k]), want[k]), k


def test_mtp_head_loads_in_the_checkpoints_format(tmp_path):
    src = write_checkpoint(tmp_path / "f", seed=3, mtp_layers=1, **{**NH_MOE, "pattern": "M*-"})
    q = quant_layouts.write(src, tmp_path / "q", "modelopt_fp8")
    assert any(e.startswith("mtp.") for e in open_checkpoint(q).entries)
    got = load_model(q)
    want = load_model(quant_layouts.dequantized_copy(q, tmp_path / "c"))
    assert got.mtp is not None
    for k, v in want.mtp.state_dict().items():  # fp8 kept packed: its decoded bits
        assert torch.equal(packed.dense(got.mtp.state_dict()[k]), v), k


def test_lists_in_the_other_naming_match(src, tmp_path):
    # ModelOpt lists written in transformers' naming (`model.`) for a NemotronH checkpoint
    # stored as `backbone.` (vllm#28072): the per-layer map still finds every module
    d = quant_layouts.write(src["nh_moe"], tmp_path / "q", "modelopt_mixed")

    def rename(q):
        q["quantized_layers"] = {k.replace("backbone.", "model.", 1): v
                                 for k, v in q["quantized_layers"].items()}
        q["exclude_modules"] = [k.replace("backbone.", "model.", 1)
                                for k in q["exclude_modules"]]

    _edit(d, hf_quant=rename)
    kinds = {e.rule.kind for e in open_checkpoint(d).entries.values()}
    assert kinds == {"nvfp4", "fp8_tensor"}
    load_model(d)
