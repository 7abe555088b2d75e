"""Qwen3.5 configs and checkpoints: both model types load, bad input is one line naming the
field and value, the multimodal layout skips (and names) the vision tower."""

from __future__ import annotations

import logging

import pytest

from baton.errors import ConfigError
from baton.model.config import config_from_dict
from baton.model.qwen3_5.make import checkpoint_config, text_config, write_checkpoint


def test_text_and_multimodal_configs_read_the_same_model():
    text = config_from_dict(text_config())
    mm = config_from_dict(checkpoint_config(multimodal=True))
    assert text.family == mm.family == "qwen3_5"
    assert (text.multimodal, mm.multimodal) == (False, True)
    assert text.pattern == mm.pattern == "GGG*GGG*"  # full_attention_interval 4
    assert text.attention_layers == (3, 7) and text.state_layers == (0, 1, 2, 4, 5, 6)
    assert text.conv_sections == (32, 32, 64) and text.rotary_dim == 16
    assert text.chunk_size == 64 and text.state_dtype == "float32"
    explicit = config_from_dict(text_config(pattern="*GG"))
    assert explicit.pattern == "*GG" and explicit.attention_layers == (0,)


def test_unserved_model_type_names_it_and_the_families():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model_type": "llama"})
    assert "'llama'" in str(e.value) and "qwen3_5" in str(e.value) and "nemotron_h" in str(e.value)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"layer_types": ["linear_attention"] * 3}, ["layer_types", "3", "num_hidden_layers=8"]),
        ({"layer_types": ["linear_attention"] * 7 + ["moe"]}, ["layer_types", "'moe'"]),
        ({"num_key_value_heads": 3}, ["num_attention_heads=4", "num_key_value_heads=3"]),
        ({"linear_num_value_heads": 3}, ["linear_num_value_heads=3", "linear_num_key_heads=2"]),
        ({"mamba_ssm_dtype": "int8"}, ["mamba_ssm_dtype", "'int8'"]),
        ({"rope_parameters": {"rope_type": "yarn"}}, ["rope_type", "'yarn'"]),
    ],
)
def test_bad_config_names_the_field_and_value(fields, words):
    with pytest.raises(ConfigError) as e:
        config_from_dict(text_config(**fields))
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_multimodal_checkpoint_skips_the_vision_tower_once(tmp_path, caplog):
    from baton.model.loader import load_model

    out = write_checkpoint(tmp_path / "mm", multimodal=True, seed=1)
    with caplog.at_level(logging.INFO, logger="baton.model"):
        model = load_model(out)
    skips = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert skips == ["skipping the vision tower: 2 tensor(s) under 'model.visual.'"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert model.config.multimodal and model.config.num_layers == 8


def test_missing_or_misshaped_tensor_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    from baton.model.loader import load_model

    out = write_checkpoint(tmp_path / "bad", seed=1)
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.1.linear_attn.in_proj_qkv.weight"
    shape = list(tensors[name].shape)
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ConfigError) as e:
        load_model(out)
    assert name in str(e.value) and str([shape[0] - 1, shape[1]]) in str(e.value)
    assert str(shape) in str(e.value)
    del tensors[name]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
        load_model(out)


def test_recurrent_state_stays_float32_in_a_bfloat16_model(tmp_path):
    import torch

    from baton.model.loader import load_model

    model = load_model(write_checkpoint(tmp_path / "bf16", seed=2), dtype=torch.bfloat16)
    pools = model.make_pools(num_blocks=4, tokens_per_block=16, num_slots=2)
    assert pools.state["recurrent"].dtype == torch.float32
    assert pools.state["conv"].dtype == pools.kv.dtype == torch.bfloat16
    assert model.model.layers[0].linear_attn.A_log.dtype == torch.float32
    ids = torch.arange(3, 40)
    first = model.prefill(ids, 0, [0, 1, 2], 1, pools).argmax()
    logits = model.decode(first[None], torch.tensor([37]), [[0, 1, 2]], torch.tensor([1]), pools)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert pools.state["recurrent"][:, 1].abs().sum() > 0 and pools.state["recurrent"][:, 0].abs().sum() == 0


def test_attention_bias_is_honoured_as_transformers_does(tmp_path):
    import torch
    import transformers

    from baton.model.loader import load_model

    out = write_checkpoint(tmp_path / "bias", seed=3, attention_bias=True, pattern="G*")
    model = load_model(out)
    assert model.model.layers[1].self_attn.q_proj.bias is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(3, 83)
    pools = model.make_pools(num_blocks=6, tokens_per_block=16, num_slots=1)
    ours = model.prefill(ids, 0, list(range(6)), 0, pools, all_logits=True)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
