"""Qwen3-Next's registry entry (`baton.model.family`): Qwen3.5's model and stage, its own
config and the interleaved DeltaNet projections split at load (`convert`)."""

from baton.model.family import FamilySpec, Weights, register

SPLIT = "baton.model.qwen3_next.convert:split_projection"

register(FamilySpec(
    name="qwen3_next",
    model_types=("qwen3_next",),
    config="baton.model.qwen3_next.config:Qwen3NextConfig",
    model="baton.model.qwen3_5.model:Qwen35Model",
    stage="baton.model.qwen3_5.stage:Qwen35Stage",
    weights=Weights(
        embeddings="model.embed_tokens.weight", fp32_suffixes=(".A_log", ".dt_bias"),
        skipped={"mtp.": "the multi-token-prediction head"},
        splits={".in_proj_qkvz.weight": SPLIT, ".in_proj_ba.weight": SPLIT}),
    make="baton.model.qwen3_next.make:write_checkpoint",
    chat_template="baton.model.tool_templates:HERMES_TEMPLATE",
))
