"""Write seeded random Qwen3.5 checkpoints in the HF layout (`qwen3_5_text`, or the published
multimodal `qwen3_5` layout with a stub vision tower), for tests and benchmarks.

Scales as in `baton.model.nemotron_h.make`: unit-variance embeddings, fan-in scaled projections,
residual outputs shrunk by depth, logits of std ~1.5; norm weights get a little seeded noise so
the zero-centred `1 + w` path is exercised.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from baton.model.progress import progress
from baton.model.qwen3_5.chat_template import TEMPLATE as QWEN_CHAT_TEMPLATE
from baton.model.qwen3_5.config import Qwen35Config

TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
# ~100M parameters: 12 DeltaNet and 4 attention layers at hidden 768.
M100 = dict(
    vocab_size=16384, hidden_size=768, intermediate_size=1280, num_hidden_layers=16,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)
PRESETS = {"tiny": TINY, "100m": M100}
COMMON = dict(
    model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_act="silu",
    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32768,
    attention_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    mamba_ssm_dtype="float32", dtype="float32",
)
VISION_STUB = {"model.visual.patch_embed.proj.weight": (8, 3, 2, 4, 4),
               "model.visual.merger.linear_fc1.weight": (16, 32)}
"""A few vision-tower tensors, so a multimodal checkpoint carries weights Baton must skip."""


def text_config(preset: str = "tiny", **fields) -> dict:
    """The text config.json dict of a preset; `pattern=` (G/*) becomes `layer_types`,
    `mtp_layers=N` an MTP head (`mtp_num_hidden_layers`, baton/model/qwen3_5/mtp.py)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose one of {sorted(PRESETS)}")
    d = {**COMMON, **PRESETS[preset]}
    mtp = fields.pop("mtp_layers", 0)
    if mtp:
        d["mtp_num_hidden_layers"] = mtp
    if "pattern" in fields:
        kinds = {"G": "linear_attention", "*": "full_attention"}
        d["layer_types"] = [kinds[c] for c in fields.pop("pattern")]
        d["num_hidden_layers"] = len(d["layer_types"])
        d.pop("full_attention_interval", None)
    d.update(fields)
    return d


def checkpoint_config(preset: str = "tiny", multimodal: bool = False, **fields) -> dict:
    text = text_config(preset, **fields)
    if not multimodal:
        return text
    return {
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"],
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 2, "out_hidden_size": text["hidden_size"]},
        "dtype": "float32",
    }


def write_checkpoint(out_dir: str | Path, *, preset: str = "tiny", seed: int = 0,
                     multimodal: bool = False, **fields) -> Path:
    """Write config.json, model.safetensors and tokenizer_config.json (a Qwen-style chat
    template) of a seeded random Qwen3.5 model into `out_dir`; returns `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = checkpoint_config(preset, multimodal, **fields)
    cfg = Qwen35Config.from_dict(d)
    tensors = random_weights(cfg, seed)
    if multimodal:
        tensors = {_multimodal_name(k): v for k, v in tensors.items()}
        gen = torch.Generator().manual_seed(seed + 1)
        tensors.update({k: torch.randn(s, generator=gen) for k, s in VISION_STUB.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    tok = {"chat_template": QWEN_CHAT_TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")
    return out


def _multimodal_name(name: str) -> str:
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def random_weights(cfg: Qwen35Config, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights for every tensor of `cfg`'s model, keyed by (text) checkpoint name."""
    from baton.model.family import of
    from baton.model.qwen3_5.model import Qwen35Model

    with torch.device("meta"):
        model = Qwen35Model(cfg)
        head = of(cfg).mtp_head(cfg)
        if head is not None:  # mtp.* sorts after lm_head and model.*: their weights stay
            model.mtp = head
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    gen = torch.Generator().manual_seed(seed)
    items = progress(sorted(shapes.items()), "making weights", "tensor")
    return {name: _init(name, shape, cfg, gen) for name, shape in items}


def _init(name: str, shape: tuple[int, ...], cfg: Qwen35Config, gen) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    if name.endswith("linear_attn.norm.weight"):
        return 1 + normal(0.1)  # the gated norm is a plain (not zero-centred) weight
    if name == "model.norm.weight" and cfg.tie_word_embeddings:
        # The unit-variance table is also the LM head: the final norm's scale 1 + w brings the
        # logits to std ~1.5 (small embeddings instead would let the residual updates dominate).
        return 1.5 / math.sqrt(cfg.hidden_size) - 1 + normal(0.01)
    if name.endswith("norm.weight") or name.startswith("mtp.pre_fc_norm_"):
        return normal(0.1)
    if name == "model.embed_tokens.weight":
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(1.5 / math.sqrt(cfg.hidden_size))
    if name.endswith(".bias"):
        return normal(0.1)
    if name.endswith(".A_log"):
        return torch.log(0.1 + 3.9 * torch.rand(shape, generator=gen))
    if name.endswith(".dt_bias"):
        return normal(0.5)
    if "conv1d" in name:
        bound = 1 / math.sqrt(cfg.linear_conv_kernel_dim)
        return (2 * torch.rand(shape, generator=gen) - 1) * bound
    std = 1 / math.sqrt(shape[-1])  # fan-in (the last axis; MoE experts are [E, out, in])
    if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight",
                      "experts.down_proj")):
        std /= math.sqrt(cfg.num_layers)  # keep the residual stream from growing with depth
    return normal(std)
