"""Qwen3.5's and Qwen3.5-MoE's registry entries (`baton.model.family`)."""

from baton.model.family import FamilySpec, Weights, register

# The published multimodal layout keeps the text model under `model.language_model.`.
WEIGHTS = Weights(
    embeddings="model.embed_tokens.weight", prefix_aliases={"model.language_model.": "model."},
    fp32_suffixes=(".A_log", ".dt_bias"),
    skipped={"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction head"})

register(FamilySpec(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_text"),
    config="baton.model.qwen3_5.config:Qwen35Config",
    model="baton.model.qwen3_5.model:Qwen35Model",
    stage="baton.model.qwen3_5.stage:Qwen35Stage",
    weights=WEIGHTS,
    make="baton.model.qwen3_5.make:write_checkpoint",
    tp="baton.model.qwen3_5.tp",
    mtp="baton.model.qwen3_5.mtp:build_head",
    named={"qwen3_5-tiny": ("qwen3_5-tiny-v2", {"family": "qwen3_5", "preset": "tiny", "seed": 0,
                                                "tokenizer": True})},
))
register(FamilySpec(  # the same layers, a MoE block as their `mlp`
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    config="baton.model.qwen3_5.moe_config:QwenMoeConfig",
    model="baton.model.qwen3_5.model:Qwen35Model",
    stage="baton.model.qwen3_5.stage:Qwen35Stage",
    weights=WEIGHTS,
    make="baton.model.qwen3_5.moe_make:write_qwen3_5_moe",
    tp="baton.model.qwen3_5.tp",
))
