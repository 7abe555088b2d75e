"""NemotronH's registry entry (`baton.model.family`)."""

from baton.model.family import FamilySpec, Weights, register

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
    named={"tiny": ("tiny-v3", {"preset": "tiny", "seed": 0, "tokenizer": True}),
           "100m": ("100m-v3", {"preset": "100m", "seed": 0, "tokenizer": True})},
    moe_experts_field="n_routed_experts",
    default=True,
))
