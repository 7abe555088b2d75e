"""Config of Qwen3.5-MoE (`qwen3_5_moe`, multimodal with `text_config`, or `qwen3_5_moe_text`),
which Qwen3-Next's (`baton.model.qwen3_next.config`, flat) extends. Both are Qwen3.5's layers
with a MoE feed-forward (`baton.model.layers.softmax_moe`) where the family puts one:

    qwen3_5_moe   every layer                      routing weights always renormalised
    qwen3_next    (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers, others a
                  dense SwiGLU of intermediate_size; renormalised when norm_topk_prob;
                  DeltaNet projections interleaved per key-head group (split at load)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

from baton.errors import ConfigError
from baton.model import flops
from baton.model.qwen3_5.config import Qwen35Config, _from_text


@dataclass(frozen=True)
class QwenMoeConfig(Qwen35Config):
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights (Qwen3.5-MoE always does)."""
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    interleaved_projections: bool = False
    """Qwen3-Next: `in_proj_qkvz` / `in_proj_ba` in the checkpoint (see qwen3_next.convert)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        e, k = self.num_experts, self.num_experts_per_tok
        if e < 1 or not 1 <= k <= e:
            raise ConfigError(f"num_experts_per_tok={k} must be between 1 and num_experts={e}")
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"decoder_sparse_step={self.decoder_sparse_step} must be at least 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(
                f"mlp_only_layers {bad} are not layers of this {self.num_layers}-layer model"
            )

    @cached_property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers whose feed-forward is the MoE block (transformers' rule)."""
        return tuple(i for i in range(self.num_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    def feed_forward_flops(self) -> int:
        """The top-k SwiGLU experts (router and shared expert not counted)."""
        return flops.mlp(self.hidden_size, self.moe_intermediate_size, gated=True) \
            * self.num_experts_per_tok

    @classmethod
    def from_dict(cls, d: dict) -> QwenMoeConfig:
        multimodal = d.get("model_type") == "qwen3_5_moe"
        text = d.get("text_config") if multimodal else d
        if not isinstance(text, dict):
            raise ConfigError("text_config: a qwen3_5_moe config.json needs a text_config object")

        def pick(name, default):
            return default if text.get(name) is None else text[name]

        return cls(
            **text_fields(text, multimodal, d), family="qwen3_5_moe",
            num_experts=int(pick("num_experts", 256)),
            num_experts_per_tok=int(pick("num_experts_per_tok", 8)),
            moe_intermediate_size=int(pick("moe_intermediate_size", 512)),
            shared_expert_intermediate_size=int(pick("shared_expert_intermediate_size", 512)),
        )


def is_sparse_layer(cfg, layer: int) -> bool:
    """Qwen3-Next: MoE unless listed in `mlp_only_layers` or off the `decoder_sparse_step`
    grid (transformers' rule); every layer of Qwen3.5-MoE is sparse (no such fields)."""
    if layer in (getattr(cfg, "mlp_only_layers", None) or ()):
        return False
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return cfg.num_experts > 0 and (layer + 1) % step == 0


def text_fields(text: dict, multimodal: bool, top: dict) -> dict:
    """Qwen3.5's fields of a text config, as keyword arguments (without `family`)."""
    base = _from_text(text, multimodal, top)
    return {f.name: getattr(base, f.name) for f in fields(Qwen35Config) if f.name != "family"}
