"""MoE checkpoints: `make-model` flags, both weight layouts, bad configs and tensors, expert
load counters, and pools / stages that treat `E` like `-` (no KV, no state)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from baton.cli import main
from baton.errors import ConfigError
from baton.model.loader import load_model, load_stage
from baton.model.nemotron_h.config import ModelConfig
from baton.model.nemotron_h.make import checkpoint_config
from baton.model.pools import PoolSpec

PATTERN = "ME*E-E"


@pytest.fixture(scope="module")
def model_moe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_ckpt")
    argv = ["make-model", "--out", str(out), "--pattern", PATTERN, "--moe-experts", "8",
            "--moe-top-k", "3", "--moe-latent-size", "48", "--seed", "4"]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def model_moe(model_moe_dir):
    return load_model(model_moe_dir)


def _logits(model, n: int = 40) -> torch.Tensor:
    ids = torch.arange(3, 3 + n) * 7 % 500
    pools = model.make_pools(num_blocks=4, tokens_per_block=16, num_slots=1)
    return model.prefill(ids, 0, [0, 1, 2, 3], 0, pools, all_logits=True)


def test_make_model_writes_the_published_layout(model_moe_dir, model_moe):
    d = json.loads((model_moe_dir / "config.json").read_text())
    assert (d["n_routed_experts"], d["num_experts_per_tok"], d["moe_latent_size"]) == (8, 3, 48)
    with safe_open(str(model_moe_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("backbone.layers.1.mixer.experts.7.up_proj.weight").get_shape() \
            == [d["moe_intermediate_size"], 48]
        assert f.get_tensor("backbone.layers.1.mixer.gate.e_score_correction_bias").abs().min() > 0
    assert not any(k.endswith("experts.up_proj") for k in keys)
    assert model_moe.backbone.layers[1].mixer.experts.up_proj.shape == (8, 128, 48)
    assert len(set(_logits(model_moe).argmax(-1).tolist())) > 10


def test_make_model_checkpoint_matches_transformers(model_moe_dir, model_moe):
    transformers = pytest.importorskip("transformers")
    hf = transformers.NemotronHForCausalLM.from_pretrained(model_moe_dir).eval()
    ids = torch.arange(3, 43) * 7 % 500
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (_logits(model_moe) - ref).abs().max().item() < 1e-4


def test_fused_layout_loads_the_same_weights(tmp_path, model_moe_dir, model_moe):
    (tmp_path / "config.json").write_text((model_moe_dir / "config.json").read_text())
    state = {"model." + k[len("backbone."):] if k.startswith("backbone.") else k: v
             for k, v in model_moe.state_dict().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    fused = load_model(tmp_path)
    for (name, a), b in zip(model_moe.state_dict().items(), fused.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(_logits(fused), _logits(model_moe))


def test_bfloat16_keeps_the_router_in_float32(model_moe_dir):
    model = load_model(model_moe_dir, dtype=torch.bfloat16)
    moe = model.backbone.layers[1].mixer
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.up_proj.dtype == torch.bfloat16


def _copy_without(src, dst, drop: str, **config):
    state = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in state.items() if drop not in k}, str(dst / "model.safetensors"))
    d = {**json.loads((src / "config.json").read_text()), **config}
    (dst / "config.json").write_text(json.dumps(d))
    return dst


def test_missing_expert_tensor_is_named(tmp_path, model_moe_dir):
    ckpt = _copy_without(model_moe_dir, tmp_path, "layers.3.mixer.experts.5.down_proj")
    with pytest.raises(ConfigError, match=r"missing tensor 'backbone\.layers\.3\.mixer\.experts"
                                          r"\.5\.down_proj\.weight' \(expert 5 of 8"):
        load_model(ckpt)


def test_latent_size_without_latent_projections_is_named(tmp_path, model_moe_dir):
    ckpt = _copy_without(model_moe_dir, tmp_path, "_latent_proj")
    with pytest.raises(ConfigError, match=r"fc1_latent_proj\.weight.*moe_latent_size=48"):
        load_model(ckpt)


@pytest.mark.parametrize("fields,message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be between 1 and n_routed_experts=8"),
    (dict(n_group=3), r"n_routed_experts=8 cannot be split into n_group=3"),
    (dict(n_group=2, topk_group=3), r"topk_group=3 must be between 1 and n_group=2"),
    (dict(n_group=8, topk_group=1), r"n_group=8 leaves 1 expert per group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), r"num_experts_per_tok=3 is more than"),
])
def test_bad_router_configs_name_the_field(fields, message):
    d = checkpoint_config("tiny", pattern=PATTERN, n_routed_experts=8, **fields)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(d)


def test_expert_load_counts_every_routed_token(model_moe_dir):
    model = load_model(model_moe_dir)
    _logits(model, n=40)
    for i in (1, 3, 5):
        counts = model.backbone.layers[i].mixer.routed_tokens
        assert counts.sum().item() == 40 * 3 and (counts > 0).sum().item() > 3


def test_moe_and_mlp_stage_holds_no_pools(model_moe_dir, model_moe):
    cfg = model_moe.config
    assert cfg.moe_layers == (1, 3, 5) and cfg.state_layers == (0,)
    spec = PoolSpec.for_model(cfg, num_blocks=8, tokens_per_block=16, num_slots=2,
                              layers=range(3, 6))
    assert spec.attn_layers == () and spec.state_layers == ()
    assert (spec.num_blocks, spec.num_slots) == (0, 0)
    stage = load_stage(model_moe_dir, range(3, 6), first=False, last=True)
    assert sorted(stage.backbone.layers) == ["3", "4", "5"]
    assert torch.equal(stage.backbone.layers["3"].mixer.experts.down_proj,
                       model_moe.backbone.layers[3].mixer.experts.down_proj)


def test_top_expert_share_gauge_and_stats_counters(model_moe_dir):
    from types import SimpleNamespace

    from baton.worker.load import expert_load
    from baton.worker.metrics import _ExpertCollector

    model = load_model(model_moe_dir)
    _logits(model, n=40)
    engine = SimpleNamespace(model=model)
    loop = SimpleNamespace(engine=engine, call=lambda fn, *a: fn(*a))
    load = expert_load(engine)
    assert sorted(load) == [1, 3, 5]
    (fam,) = _ExpertCollector("decode", loop).collect()
    shares = {s.labels["layer"]: s.value for s in fam.samples}
    assert shares == {str(i): max(load[i]) / (40 * 3) for i in (1, 3, 5)}
    assert all(1 / 8 <= v < 1 for v in shares.values())
    dense = SimpleNamespace(config=ModelConfig.from_dict(checkpoint_config("tiny")))
    assert expert_load(SimpleNamespace(model=dense)) == {}  # no MoE layer: nothing to ask
