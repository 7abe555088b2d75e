"""Qwen3-Next's config (`qwen3_next`, flat): Qwen3.5-MoE's fields, with MoE feed-forwards on a
sparse-step grid (`decoder_sparse_step`, `mlp_only_layers`), routing renormalised only when
`norm_topk_prob`, and interleaved DeltaNet projections in the checkpoint (`convert`)."""

from __future__ import annotations

from dataclasses import dataclass

from baton.model.qwen3_5.moe_config import QwenMoeConfig, text_fields


@dataclass(frozen=True)
class Qwen3NextConfig(QwenMoeConfig):
    @classmethod
    def from_dict(cls, d: dict) -> Qwen3NextConfig:
        def pick(name, default):
            return default if d.get(name) is None else d[name]

        return cls(
            **text_fields(d, False, d), family="qwen3_next",
            num_experts=int(pick("num_experts", 512)),
            num_experts_per_tok=int(pick("num_experts_per_tok", 10)),
            moe_intermediate_size=int(pick("moe_intermediate_size", 512)),
            shared_expert_intermediate_size=int(pick("shared_expert_intermediate_size", 512)),
            norm_topk_prob=bool(pick("norm_topk_prob", True)),
            decoder_sparse_step=int(pick("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in pick("mlp_only_layers", ())),
            interleaved_projections=True,
        )
