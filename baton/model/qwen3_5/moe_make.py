"""Write seeded random Qwen MoE checkpoints in a published `Layout`: Qwen3.5-MoE's here
(`qwen3_5_moe_text`, or multimodal `qwen3_5_moe` with a vision stub, experts fused
(`mlp.experts.gate_up_proj` [E, 2I, H]) as the released checkpoint keeps them); another
family that reuses these layers passes its own (Qwen3-Next: `baton/model/qwen3_next/make.py`).

Weights as `baton.model.qwen3_5.make` draws them (its presets, scales and chat template).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from baton.model.config import config_from_dict
from baton.model.qwen3_5 import make


@dataclass(frozen=True)
class Layout:
    """How a family publishes a checkpoint of these layers."""

    model_type: str = "qwen3_5_moe_text"
    architecture: str = "Qwen3_5MoeForCausalLM"
    fields: dict = field(default_factory=dict)
    """config.json fields after the MoE sizes (the caller's `fields` override them)."""
    chat_template: str = make.QWEN_CHAT_TEMPLATE
    multimodal: bool = True
    """Has a multimodal layout (`qwen3_5_moe` with a vision stub)."""
    convert: Callable | None = None
    """(cfg, tensors) -> the family's own layout of the tensors."""


QWEN3_5_MOE = Layout()


def text_config(layout: Layout = QWEN3_5_MOE, preset: str = "tiny", **fields) -> dict:
    d = make.text_config(preset, **{k: v for k, v in fields.items() if k == "pattern"})
    width = d["intermediate_size"] // 2
    d.update(model_type=layout.model_type, architectures=[layout.architecture], num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=width,
             shared_expert_intermediate_size=width)
    d.update(layout.fields)
    d.update({k: v for k, v in fields.items() if k != "pattern"})
    return d


def checkpoint_config(layout: Layout = QWEN3_5_MOE, preset: str = "tiny",
                      multimodal: bool = False, **fields) -> dict:
    text = text_config(layout, preset, **fields)
    if not multimodal:
        return text
    if not layout.multimodal:
        raise ValueError(f"model_type={layout.model_type!r} has no multimodal layout "
                         "(qwen3_5_moe has)")
    return {
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"],
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 2, "out_hidden_size": text["hidden_size"]},
        "dtype": "float32",
    }


def write_checkpoint(out_dir: str | Path, *, layout: Layout = QWEN3_5_MOE, preset: str = "tiny",
                     seed: int = 0, multimodal: bool = False, **fields) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = checkpoint_config(layout, preset, multimodal, **fields)
    cfg = config_from_dict(d)
    tensors = make.random_weights(cfg, seed)
    if layout.convert is not None:
        tensors = layout.convert(cfg, tensors)
    if multimodal:
        tensors = {make._multimodal_name(k): v for k, v in tensors.items()}
        gen = torch.Generator().manual_seed(seed + 1)
        tensors.update({k: torch.randn(s, generator=gen) for k, s in make.VISION_STUB.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    tok = {"chat_template": layout.chat_template, "bos_token": None, "eos_token": "<|im_end|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")
    return out


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused `experts.gate_up_proj` / `experts.down_proj` as one tensor per expert."""
    out = {}
    for name, w in state.items():
        pre, _, proj = name.rpartition(".")
        if not pre.endswith(".experts") or w.dim() != 3:
            out[name] = w
            continue
        for e in range(w.shape[0]):
            if proj == "gate_up_proj":
                gate, up = w[e].chunk(2)
                out[f"{pre}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{pre}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{pre}.{e}.{proj}.weight"] = w[e].contiguous()
    return out


def write_qwen3_5_moe(out_dir: str | Path, **kw) -> Path:
    """Qwen3.5-MoE's checkpoint maker (`baton.model.qwen3_5.family`)."""
    return write_checkpoint(out_dir, **kw)
