"""Qwen3.5's and Qwen3.5-MoE's registry entries (`baton.model.family`)."""

from baton.model.family import FamilySpec, TrainRecipe, Weights, register

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
    chat_template="baton.model.qwen3_5.chat_template:TEMPLATE",
    # tied embeddings, as the published small Qwen3.5 models have
    train=TrainRecipe(
        sizes={
            "tiny": dict(pattern="GG*", hidden_size=64, intermediate_size=128,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         linear_num_key_heads=1, linear_num_value_heads=2,
                         linear_key_head_dim=16, linear_value_head_dim=16),
            "small": dict(pattern="GGG*GGG*", hidden_size=256, intermediate_size=384,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=64, linear_value_head_dim=64),
            "base": dict(pattern="GGG*GGG*GGG*", hidden_size=320, intermediate_size=640,
                         num_attention_heads=5, num_key_value_heads=1, head_dim=64,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=64, linear_value_head_dim=64),
        },
        mtp_head="baton.model.qwen3_5.train_mtp:build",
        planned=("small", 3000), shipped="code-qwen3_5",
        fields={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.25},
                "max_position_embeddings": 8192, "tie_word_embeddings": True}),
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
    chat_template="baton.model.qwen3_5.chat_template:TEMPLATE",
    tp="baton.model.qwen3_5.tp",
))
