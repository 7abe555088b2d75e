"""NemotronH at tensor-parallel size t (loaded by `baton.model.tp_loader`): rank r's model is
an ordinary `NemotronHModel` built
from a LOCAL config (its heads, groups, FFN and vocab shares), with the output projections,
embedding, LM head and (replicated-groups) gated norm swapped for `layers.parallel`, and its
weights cut from the TP-1 checkpoint section by section.

    in_proj rows   [ z | x | B | C | dt ]  each section cut on its own (by heads / groups);
                   n_groups == 1: B and C whole on every rank
    conv1d rows    [ x | B | C ]           likewise (so the conv state is the rank's shard
                                            in `tp_shard`'s layout)
    A_log, D, dt_bias, norm                by heads / channels
    out_proj, o_proj, down_proj columns    row parallel (one all-reduce each)
    q rows by heads; k, v rows by KV heads (replicated: head r*K // t, division)
    MoE (`E`)                              `layers.moe_tp`: router and latent projections
                                            whole; routed experts whole per rank
                                            (`experts`, rows of [E, ..]) or each split
                                            within (`within`); shared expert by its width;
                                            one all-reduce per layer. Published per-expert
                                            tensors: only the rank's are read (`tp_stacks`)

The local config's pools are exactly the rank's shard of the cache (`tp_shard`): KV heads
max(K/t, 1), conv (I/t + 2*G_local*N, K-1), ssm (H/t, P, N).
"""

from __future__ import annotations

import dataclasses

from baton.model.layers.mamba2 import Mamba2Mixer
from baton.model.layers.moe import MoE
from baton.model.layers.moe_tp import MODES, TPMoE, check_split
from baton.model.layers.parallel import ReplicatedGroupGatedNorm, TPGroup, row_parallel
from baton.model.nemotron_h.config import ModelConfig
from baton.model.tp_shard import check_tp


def local_config(cfg: ModelConfig, tp: int, moe_split: str = MODES[0]) -> ModelConfig:
    """The config whose modules and pools are one rank's shard (the MoE fields stay the
    model's: `layers.moe_tp` shards those modules itself)."""
    check_tp(cfg, tp)
    if "E" in cfg.pattern:
        check_split(cfg, tp, moe_split, "n_routed_experts", "moe_intermediate_size",
                    "moe_shared_expert_intermediate_size")
    if tp == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=max(cfg.num_key_value_heads // tp, 1),
        intermediate_size=cfg.intermediate_size // tp,
        mamba_num_heads=cfg.mamba_num_heads // tp, n_groups=max(cfg.n_groups // tp, 1),
        vocab_size=cfg.vocab_size // tp)


def sections(cfg: ModelConfig, what: str) -> list[tuple[int, int]]:
    """(units, unit width) of each section along a weight's sharded axis."""
    H, P, G, N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    return {
        "in_proj": [(H, P), (H, P), (G, N), (G, N), (H, 1)],
        "conv": [(H, P), (G, N), (G, N)],
        "heads": [(H, 1)], "inner": [(H, P)],
        "q": [(cfg.num_attention_heads, cfg.head_dim)],
        "kv": [(cfg.num_key_value_heads, cfg.head_dim)],
        "ffn": [(cfg.intermediate_size, 1)], "vocab": [(cfg.vocab_size, 1)],
        "experts": [(cfg.n_routed_experts, 1)], "moe_ffn": [(cfg.moe_intermediate_size, 1)],
        "shared": [(cfg.moe_shared_expert_intermediate_size, 1)],
    }[what]


RULES = (  # (name suffix, sections, axis); anything else is replicated
    ("mixer.in_proj.weight", "in_proj", 0), ("mixer.in_proj.bias", "in_proj", 0),
    ("mixer.conv1d.weight", "conv", 0), ("mixer.conv1d.bias", "conv", 0),
    ("mixer.dt_bias", "heads", 0), ("mixer.A_log", "heads", 0), ("mixer.D", "heads", 0),
    ("mixer.norm.weight", "inner", 0), ("mixer.out_proj.weight", "inner", 1),
    ("mixer.q_proj.weight", "q", 0), ("mixer.k_proj.weight", "kv", 0),
    ("mixer.v_proj.weight", "kv", 0), ("mixer.o_proj.weight", "q", 1),
    ("mixer.up_proj.weight", "ffn", 0), ("mixer.up_proj.bias", "ffn", 0),
    ("mixer.down_proj.weight", "ffn", 1),
    ("backbone.embeddings.weight", "vocab", 0), ("lm_head.weight", "vocab", 0),
    ("mixer.shared_experts.up_proj.weight", "shared", 0),
    ("mixer.shared_experts.up_proj.bias", "shared", 0),
    ("mixer.shared_experts.down_proj.weight", "shared", 1),
)
MOE_RULES = {  # the stacked routed experts [E, out, in], by `moe_split`
    "experts": (("mixer.experts.up_proj", "experts", 0),
                ("mixer.experts.down_proj", "experts", 0)),
    "within": (("mixer.experts.up_proj", "moe_ffn", 1),
               ("mixer.experts.down_proj", "moe_ffn", 2)),
}


def parallelize(cfg: ModelConfig, tp: TPGroup, blocks, moe_split: str) -> None:
    """Swap in the modules of `blocks` that talk over the group (TP > 1; the embedding and
    LM head are `tp_loader`'s)."""
    lc = local_config(cfg, tp.size, moe_split)
    for block in blocks:
        m = block.mixer
        if isinstance(m, MoE):
            block.mixer = TPMoE(cfg, m.layer_idx, tp, moe_split)
            continue
        row_parallel(m, ("out_proj", "o_proj", "down_proj"), tp)
        if isinstance(m, Mamba2Mixer) and cfg.n_groups == 1:
            m.norm = ReplicatedGroupGatedNorm(lc.mamba_intermediate, cfg.mamba_intermediate,
                                              cfg.layer_norm_epsilon, tp)
