"""Write seeded random Qwen3.5-MoE and Qwen3-Next checkpoints in their published layouts:

    qwen3_5_moe   `qwen3_5_moe_text` (or multimodal `qwen3_5_moe` with a vision stub), experts
                  fused (`mlp.experts.gate_up_proj` [E, 2I, H]) as the released checkpoint keeps them
    qwen3_next    flat `qwen3_next`, experts one tensor each (`mlp.experts.{e}.gate_proj.weight`
                  ...), DeltaNet projections interleaved (`in_proj_qkvz`, `in_proj_ba`)

Weights as `baton.model.qwen3_5.make` draws them (its presets, scales and chat template).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from baton.model.config import config_from_dict
from baton.model.qwen3_5 import make
from baton.model.tool_templates import HERMES_TEMPLATE

ARCH = {"qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def text_config(family: str, preset: str = "tiny", **fields) -> dict:
    d = make.text_config(preset, **{k: v for k, v in fields.items() if k == "pattern"})
    width = d["intermediate_size"] // 2
    d.update(model_type="qwen3_5_moe_text" if family == "qwen3_5_moe" else family,
             architectures=[ARCH[family]], num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=width, shared_expert_intermediate_size=width)
    if family == "qwen3_next":
        d.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    d.update({k: v for k, v in fields.items() if k != "pattern"})
    return d


def checkpoint_config(family: str, preset: str = "tiny", multimodal: bool = False,
                      **fields) -> dict:
    text = text_config(family, preset, **fields)
    if not multimodal:
        return text
    if family != "qwen3_5_moe":
        raise ValueError(f"family={family!r} has no multimodal layout (qwen3_5_moe has)")
    return {
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"],
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 2, "out_hidden_size": text["hidden_size"]},
        "dtype": "float32",
    }


def write_checkpoint(out_dir: str | Path, *, family: str, preset: str = "tiny", seed: int = 0,
                     multimodal: bool = False, convert=None, **fields) -> Path:
    """`convert(cfg, tensors)`: the family's own layout of the tensors (Qwen3-Next's)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = checkpoint_config(family, preset, multimodal, **fields)
    cfg = config_from_dict(d)
    tensors = make.random_weights(cfg, seed)
    if convert is not None:
        tensors = convert(cfg, tensors)
    if multimodal:
        tensors = {make._multimodal_name(k): v for k, v in tensors.items()}
        gen = torch.Generator().manual_seed(seed + 1)
        tensors.update({k: torch.randn(s, generator=gen) for k, s in make.VISION_STUB.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    template = HERMES_TEMPLATE if family == "qwen3_next" else make.QWEN_CHAT_TEMPLATE
    tok = {"chat_template": template, "bos_token": None, "eos_token": "<|im_end|>"}
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
    return write_checkpoint(out_dir, family="qwen3_5_moe", **kw)
