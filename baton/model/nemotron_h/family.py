"""NemotronH's registry entry (`baton.model.family`)."""

from baton.model.family import FamilySpec, TrainRecipe, Weights, register

register(FamilySpec(
    name="nemotron_h",
    model_types=("nemotron_h",),
    config="baton.model.nemotron_h.config:ModelConfig",
    model="baton.model.nemotron_h.model:NemotronHModel",
    stage="baton.model.nemotron_h.stage:StageModel",
    # transformers' in-memory names use `model.`; NemotronH checkpoints on disk `backbone.`;
    # the MoE router stays float32 too, as transformers keeps it
    weights=Weights(
        embeddings="backbone.embeddings.weight", prefix_aliases={"model.": "backbone."},
        fp32_suffixes=(".A_log", ".D", ".dt_bias", ".gate.weight",
                       ".gate.e_score_correction_bias")),
    make="baton.model.nemotron_h.make:write_checkpoint",
    tp="baton.model.nemotron_h.tp",
    mtp="baton.model.nemotron_h.mtp:build_head",
    chat_template="baton.model.nemotron_h.chat_template:TEMPLATE",
    train=TrainRecipe(
        sizes={
            "tiny": dict(pattern="M*-M", hidden_size=64, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, intermediate_size=128,
                         mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                         chunk_size=32),
            "small": dict(pattern="M-M*M-M-", hidden_size=256, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, intermediate_size=512,
                          mamba_num_heads=16, mamba_head_dim=32, ssm_state_size=32, n_groups=2,
                          chunk_size=64),
            "base": dict(pattern="M-M*M-M-M*M-", hidden_size=320, num_attention_heads=5,
                         num_key_value_heads=1, head_dim=64, intermediate_size=960,
                         mamba_num_heads=20, mamba_head_dim=32, ssm_state_size=32, n_groups=2,
                         chunk_size=64),
        },
        mtp_head="baton.model.nemotron_h.train_mtp:build",
        planned=("small", 4000), shipped="code-nemotron_h",
        fields={"max_position_embeddings": 8192},
        published_prefixes={"model.": "backbone."}),
    named={"tiny": ("tiny-v3", {"preset": "tiny", "seed": 0, "tokenizer": True}),
           "100m": ("100m-v3", {"preset": "100m", "seed": 0, "tokenizer": True})},
    moe_experts_field="n_routed_experts",
    default=True,
))
