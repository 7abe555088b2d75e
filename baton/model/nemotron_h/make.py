"""Write seeded random NemotronH checkpoints in the HF layout, for tests and benchmarks
(MoE experts one tensor each, as published checkpoints store them).

The weights are scaled so the model is not degenerate: unit-variance embeddings, fan-in scaled
projections, residual outputs shrunk by depth and an lm_head that gives logits of std ~1.5,
so greedy decoding follows the input instead of repeating one token.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from baton.model.chat_template import tokenizer_config
from baton.model.nemotron_h.config import ModelConfig
from baton.model.nemotron_h.model import NemotronHModel
from baton.model.nemotron_h.mtp import MTPHead, mtp_spec
from baton.model.progress import progress

TINY = dict(
    hybrid_override_pattern="M*M-M*M-",
    vocab_size=512,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=32,
)
# ~100M parameters: 12 Mamba, 4 attention and 8 MLP layers at hidden 768.
M100 = dict(
    hybrid_override_pattern="M-M*M-M-M*M-M-M*M-M-M*M-",
    vocab_size=16384,
    hidden_size=768,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2048,
    mamba_num_heads=24,
    mamba_head_dim=64,
    ssm_state_size=64,
    n_groups=4,
    conv_kernel=4,
    chunk_size=128,
)
PRESETS = {"tiny": TINY, "100m": M100}
COMMON = dict(
    model_type="nemotron_h",
    architectures=["NemotronHForCausalLM"],
    mlp_hidden_act="relu2",
    mamba_hidden_act="silu",
    layer_norm_epsilon=1e-5,
    use_conv_bias=True,
    use_bias=False,
    mlp_bias=False,
    attention_bias=False,
    tie_word_embeddings=False,
    time_step_min=0.001,
    time_step_max=0.1,
    max_position_embeddings=131072,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    torch_dtype="float32",
)


def checkpoint_config(preset: str = "tiny", **fields) -> dict:
    """The config.json dict of a preset; `pattern=` is accepted for `hybrid_override_pattern`,
    `mtp_layers=N` for an MTP head (`num_nextn_predict_layers` N; an attention block, then a
    MoE block `*E` when the target has MoE layers, else a dense `*-` one, unless
    `mtp_hybrid_override_pattern` says otherwise; see baton/model/nemotron_h/mtp.py)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {sorted(PRESETS)}")
    if "pattern" in fields:
        fields["hybrid_override_pattern"] = fields.pop("pattern")
    mtp = fields.pop("mtp_layers", 0)
    d = {**COMMON, **PRESETS[preset], **fields}
    d["num_hidden_layers"] = len(d["hybrid_override_pattern"])
    if mtp:
        block = "*E" if "E" in d["hybrid_override_pattern"] else "*-"
        d = {"num_nextn_predict_layers": mtp, "mtp_hybrid_override_pattern": block, **d}
    if "E" in d["hybrid_override_pattern"] + d.get("mtp_hybrid_override_pattern", ""):
        d = {**_moe_defaults(d), **d}
    return d


def _moe_defaults(d: dict) -> dict:
    """Nano-like router settings, expert widths scaled to the preset's MLP."""
    return dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=d["intermediate_size"] // 2,
        moe_shared_expert_intermediate_size=d["intermediate_size"], routed_scaling_factor=2.5,
        n_group=1, topk_group=1, norm_topk_prob=True,
        n_shared_experts=1,  # as published: HF ignores it, llama.cpp's converter reads it
    )


def write_checkpoint(out_dir: str | Path, *, preset: str = "tiny", seed: int = 0,
                     **fields) -> Path:
    """Write config.json, model.safetensors and tokenizer_config.json (a simple chat template)
    of a seeded random NemotronH into `out_dir` (`fields` override config.json entries: HF
    names, plus `pattern`). Returns `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = checkpoint_config(preset, **fields)
    cfg = ModelConfig.from_dict(d)
    tensors = random_weights(cfg, seed)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return out


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights for every tensor of `cfg`'s model, keyed by checkpoint name."""
    with torch.device("meta"):
        model = NemotronHModel(cfg)
        spec = mtp_spec(cfg)
        if spec is not None:  # sorts after backbone.* and lm_head: their weights do not change
            model.mtp = MTPHead(cfg, spec)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    shapes = _per_expert(shapes)
    gen = torch.Generator().manual_seed(seed)
    items = progress(sorted(shapes.items()), "making weights", "tensor")
    return {name: _init(name, shape, cfg, gen) for name, shape in items}


def _per_expert(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Fused [E, out, in] expert parameters as the published layout's one tensor per expert."""
    out = {}
    for name, shape in shapes.items():
        pre, _, proj = name.rpartition(".")
        if pre.endswith(".experts") and len(shape) == 3:
            out.update({f"{pre}.{e}.{proj}.weight": shape[1:] for e in range(shape[0])})
        else:
            out[name] = shape
    return out


def _init(name: str, shape: tuple[int, ...], cfg: ModelConfig, gen) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=gen)

    if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
        return torch.ones(shape)
    if name.endswith(".bias") and "conv1d" not in name:
        return torch.zeros(shape)
    if name.endswith(".e_score_correction_bias"):
        return normal(0.1)  # non-zero, as trained checkpoints: it steers the expert choice
    if name == "backbone.embeddings.weight":
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(1.5 / math.sqrt(cfg.hidden_size))
    if name.endswith(".A_log"):
        return torch.log(uniform(1.0, 16.0))
    if name.endswith(".dt_bias"):
        dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1)))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if "conv1d" in name:
        bound = 1 / math.sqrt(cfg.conv_kernel)
        return uniform(-bound, bound)
    std = 1 / math.sqrt(shape[1])
    if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(cfg.num_layers)  # keep the residual stream from growing with depth
    return normal(std)
