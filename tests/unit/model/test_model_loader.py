"""Checkpoint loading: sharding, tied embeddings, dtypes, and actionable errors."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.errors import ConfigError
from baton.model.loader import load_model
from baton.model.make_model import write_checkpoint
from baton.model.nemotron_h.config import ModelConfig

pytestmark = pytest.mark.usefixtures("model_single_thread")

IDS = torch.tensor([5, 77, 300, 12, 9, 410, 3])


def _logits(model) -> torch.Tensor:
    pools = model.make_pools(1, 16, 1)
    return model.prefill(IDS, 0, [0], 0, pools, all_logits=True)


def _rewrite(ckpt, edit) -> None:
    """Apply `edit` to the checkpoint's tensor dict and save it back."""
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(tmp_path):
    ckpt = write_checkpoint(tmp_path, seed=0)
    _rewrite(ckpt, lambda t: t.pop("backbone.layers.1.mixer.k_proj.weight"))
    with pytest.raises(ConfigError, match=r"missing tensor.*backbone\.layers\.1\.mixer\.k_proj"):
        load_model(ckpt)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    ckpt = write_checkpoint(tmp_path, seed=0)
    _rewrite(ckpt, lambda t: t.update({"backbone.norm_f.weight": torch.ones(7)}))
    with pytest.raises(ConfigError, match=r"'backbone\.norm_f\.weight'.*\[7\].*\[128\]"):
        load_model(ckpt)


def test_unexpected_tensors_warn_and_are_ignored(tmp_path, caplog):
    ckpt = write_checkpoint(tmp_path, seed=0)
    ref = _logits(load_model(ckpt))
    _rewrite(ckpt, lambda t: t.update({"mtp.layers.0.norm.weight": torch.ones(128)}))
    with caplog.at_level(logging.WARNING, logger="baton.model"):
        model = load_model(ckpt)
    assert "mtp.layers.0.norm.weight" in caplog.text
    assert torch.equal(_logits(model), ref)


def test_unsupported_layer_kind_is_rejected(tmp_path):
    ckpt = write_checkpoint(tmp_path, seed=0)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["hybrid_override_pattern"] = "M*X-"  # `E` (MoE) is served since issue 20
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"unsupported layer kind\(s\) \['X'\]"):
        load_model(ckpt)


def test_layers_block_type_config_form(tmp_path):
    ckpt = write_checkpoint(tmp_path, seed=0)
    ref = _logits(load_model(ckpt))
    cfg = json.loads((ckpt / "config.json").read_text())
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    cfg["layers_block_type"] = [kinds[c] for c in cfg.pop("hybrid_override_pattern")]
    cfg["time_step_limit"] = [0.0, {"__float__": "Infinity"}]  # as transformers writes it
    (ckpt / "config.json").write_text(json.dumps(cfg))
    model = load_model(ckpt)
    assert model.config.pattern == "M*M-M*M-"
    assert model.config.dt_limit == (0.001, float("inf"))
    assert torch.equal(_logits(model), ref)


@pytest.mark.parametrize("with_index", [True, False])
def test_sharded_checkpoint(tmp_path, with_index):
    ckpt = write_checkpoint(tmp_path, seed=0)
    ref = _logits(load_model(ckpt))
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, ckpt / file)
    if with_index:
        weight_map = {k: f for f, part in shards.items() for k in part}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(_logits(load_model(ckpt)), ref)


def test_tied_embeddings_need_no_lm_head(tmp_path):
    ckpt = write_checkpoint(tmp_path, seed=0, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(ckpt / "model.safetensors")
    model = load_model(ckpt)
    assert model.lm_head.weight is model.backbone.embeddings.weight
    assert len(set(_logits(model).argmax(-1).tolist())) > 1


def test_bfloat16_load_keeps_mamba_scalars_in_float32(tmp_path, model_tiny):
    ckpt = write_checkpoint(tmp_path, seed=0)
    model = load_model(ckpt, dtype=torch.bfloat16)
    mixer = model.backbone.layers[0].mixer
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert mixer.A_log.dtype == mixer.D.dtype == mixer.dt_bias.dtype == torch.float32
    pools = model.make_pools(1, 16, 1)
    assert pools.kv.dtype == torch.bfloat16
    got = model.prefill(IDS, 0, [0], 0, pools, all_logits=True)
    ref = _logits(model_tiny)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.25  # bf16 rounding through 8 layers


def test_model_prefix_alias_loads(tmp_path):
    """transformers' in-memory names (`model.` instead of `backbone.`) load too."""
    ckpt = write_checkpoint(tmp_path, seed=0)
    ref = _logits(load_model(ckpt))
    _rewrite(
        ckpt, lambda t: t.update({k.replace("backbone.", "model.", 1): t.pop(k) for k in list(t)})
    )
    assert torch.equal(_logits(load_model(ckpt)), ref)


def test_missing_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)
    ckpt = write_checkpoint(tmp_path, seed=0)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        load_model(ckpt)


def test_write_checkpoint_is_deterministic(tmp_path):
    a = load_file(write_checkpoint(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(write_checkpoint(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(write_checkpoint(tmp_path / "c", seed=4) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_presets_have_expected_shape(tmp_path):
    from baton.model.nemotron_h import NemotronHModel
    from baton.model.nemotron_h.make import checkpoint_config

    cfg = ModelConfig.from_dict(checkpoint_config("100m"))
    with torch.device("meta"):
        n = sum(p.numel() for p in NemotronHModel(cfg).parameters())
    assert 90e6 < n < 120e6
    tiny = ModelConfig.from_dict(checkpoint_config("tiny"))
    assert set(tiny.pattern) == set("M*-") and tiny.vocab_size >= 259


def test_building_the_skeleton_skips_random_init_and_never_imports_dynamo(model_tiny_dir):
    """The model is built on the meta device without its modules' random fills (whose meta
    kernels import torch._dynamo: ~1.4 s of CPU in every worker, rank and stage process), and
    loads the checkpoint's weights as before."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from baton.model.loader import load_model\n"
            f"m = load_model({str(model_tiny_dir)!r})\n"
            "assert all(not p.is_meta for p in m.parameters())\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]
