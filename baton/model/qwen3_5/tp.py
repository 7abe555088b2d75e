"""Qwen3.5 at tensor-parallel size t: rank r's model is an ordinary `Qwen35Model` (or stage)
built from a LOCAL config, with the output projections, embedding and LM head swapped for
`layers.parallel`, and its weights cut from the TP-1 checkpoint section by section (loaded
by `baton.model.tp_loader.load_tp_model`).

    in_proj_qkv rows  [ q | k | v ]   q, k by key heads (replicated by division when TP
                                      exceeds them: a rank's value heads all read the key
                                      head r*HK // t), v by value heads
    conv1d rows       [ q | k | v ]   likewise (the conv state is the rank's shard)
    in_proj_z, in_proj_a/b, A_log, dt_bias   by value heads; norm (per head) replicated
    q_proj rows by heads ([q_h | gate_h] per head); k, v by KV heads (replicated: division)
    out_proj, o_proj, down_proj columns: row parallel, one all-reduce per mixer and per MLP
    MoE `mlp` (Qwen3.5-MoE)           `layers.moe_tp`: router and shared-expert gate whole;
                                      experts whole per rank or split within (gate and up
                                      rows each, down columns); shared expert by its width
"""

from __future__ import annotations

import dataclasses

from baton.model.layers.moe_tp import MODES, TPSoftmaxMoE, check_split
from baton.model.layers.parallel import TPGroup, row_parallel
from baton.model.layers.softmax_moe import SoftmaxMoE
from baton.model.qwen3_5.config import Qwen35Config
from baton.model.tp_shard import check_tp


def local_config(cfg: Qwen35Config, tp: int, moe_split: str = MODES[0]) -> Qwen35Config:
    """The config whose modules and pools are one rank's shard (the MoE fields stay the
    model's: `layers.moe_tp` shards those modules itself)."""
    check_tp(cfg, tp)
    if getattr(cfg, "moe_layers", ()):
        check_split(cfg, tp, moe_split, "num_experts", "moe_intermediate_size",
                    "shared_expert_intermediate_size")
    if tp == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=max(cfg.num_key_value_heads // tp, 1),
        linear_num_key_heads=max(cfg.linear_num_key_heads // tp, 1),
        linear_num_value_heads=cfg.linear_num_value_heads // tp,
        intermediate_size=cfg.intermediate_size // tp, vocab_size=cfg.vocab_size // tp)


def sections(cfg: Qwen35Config, what: str) -> list[tuple[int, int]]:
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return {
        "qkv": [(hk, dk), (hk, dk), (hv, dv)], "z": [(hv, dv)], "vheads": [(hv, 1)],
        "q": [(cfg.num_attention_heads, 2 * cfg.head_dim)],
        "o": [(cfg.num_attention_heads, cfg.head_dim)],
        "kv": [(cfg.num_key_value_heads, cfg.head_dim)],
        "ffn": [(cfg.intermediate_size, 1)], "vocab": [(cfg.vocab_size, 1)],
        "experts": [(getattr(cfg, "num_experts", 0), 1)],
        "moe_ffn": [(getattr(cfg, "moe_intermediate_size", 0), 1)],
        "moe_gate_up": [(getattr(cfg, "moe_intermediate_size", 0), 1)] * 2,
        "shared": [(getattr(cfg, "shared_expert_intermediate_size", 0), 1)],
    }[what]


RULES = (  # (name suffix, sections, axis); anything else is replicated
    ("linear_attn.in_proj_qkv.weight", "qkv", 0), ("linear_attn.conv1d.weight", "qkv", 0),
    ("linear_attn.in_proj_z.weight", "z", 0), ("linear_attn.in_proj_a.weight", "vheads", 0),
    ("linear_attn.in_proj_b.weight", "vheads", 0), ("linear_attn.A_log", "vheads", 0),
    ("linear_attn.dt_bias", "vheads", 0), ("linear_attn.out_proj.weight", "z", 1),
    ("self_attn.q_proj.weight", "q", 0), ("self_attn.k_proj.weight", "kv", 0),
    ("self_attn.v_proj.weight", "kv", 0), ("self_attn.o_proj.weight", "o", 1),
    ("mlp.gate_proj.weight", "ffn", 0), ("mlp.up_proj.weight", "ffn", 0),
    ("mlp.down_proj.weight", "ffn", 1),
    ("model.embed_tokens.weight", "vocab", 0), ("lm_head.weight", "vocab", 0),
    ("mlp.shared_expert.gate_proj.weight", "shared", 0),
    ("mlp.shared_expert.up_proj.weight", "shared", 0),
    ("mlp.shared_expert.down_proj.weight", "shared", 1),
)
MOE_RULES = {  # the stacked routed experts, by `moe_split`: gate_up [E, 2I, H], down [E, H, I]
    "experts": (("mlp.experts.gate_up_proj", "experts", 0),
                ("mlp.experts.down_proj", "experts", 0)),
    "within": (("mlp.experts.gate_up_proj", "moe_gate_up", 1),  # gate and up rows each
               ("mlp.experts.down_proj", "moe_ffn", 2)),
}


def parallelize(cfg: Qwen35Config, tp: TPGroup, layers, moe_split: str) -> None:
    """Swap in the modules of `layers` that talk over the group (TP > 1; the embedding and
    LM head are `tp_loader`'s)."""
    for layer in layers:
        if isinstance(layer.mlp, SoftmaxMoE):
            layer.mlp = TPSoftmaxMoE(cfg, layer.mlp.layer_idx, layer.mlp.norm, tp, moe_split)
        row_parallel(layer.mixer, ("out_proj", "o_proj"), tp)
        row_parallel(layer.mlp, ("down_proj",), tp)
