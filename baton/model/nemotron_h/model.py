"""NemotronH causal LM over Baton's paged pools: its blocks (one mixer each: Mamba2 `M`,
attention `*`, MLP `-`, MoE `E`) in `baton.model.hybrid.HybridLM`.

Module names mirror the HF checkpoint (`backbone.layers.{i}.mixer.*`, `lm_head.weight`), so
`load_state_dict` takes a real NemotronH checkpoint unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.model.hybrid import HybridLM
from baton.model.layers.attention import Attention
from baton.model.layers.mamba2 import Mamba2Mixer
from baton.model.layers.mlp import MLP
from baton.model.layers.moe import MoE
from baton.model.layers.norms import RMSNorm
from baton.model.nemotron_h.config import ModelConfig
from baton.model.paged import StepContext
from baton.model.protocol import Mix

MIXERS = {"M": Mamba2Mixer, "*": Attention, "-": MLP, "E": MoE}


class Block(nn.Module):
    """Pre-norm residual block around one mixer."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = MIXERS[cfg.pattern[layer_idx]](cfg, layer_idx=layer_idx)
        # MLP and MoE mixers read no KV or state: one forward for prefill and decode
        self.stateless = getattr(self.mixer, "stateless", False)

    def forward(self, h: torch.Tensor, ctx: StepContext, decode: bool) -> torch.Tensor:
        x = self.norm(h)
        if self.stateless:
            return h + self.mixer(x)
        return h + (self.mixer.decode(x, ctx) if decode else self.mixer.prefill(x, ctx))

    def run_mixed(self, h: torch.Tensor, mix: Mix) -> torch.Tensor:
        x = self.norm(h)
        return h + (self.mixer(x) if self.stateless else mix(self.mixer, x))


def nemotron_parts(block: Block):
    """A `Block`'s parts for `fast_decode`: one, its mixer (or MLP / MoE)."""
    n = block.norm
    return [(n.weight, n.eps, n.weight, block.mixer, not block.stateless)]


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class NemotronHModel(HybridLM):
    state_kind = "Mamba"
    fast_parts = staticmethod(nemotron_parts)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.mtp: nn.Module | None = None
        """The MTP head, when the checkpoint has one (`baton.model.loader.attach_mtp`)."""
        self.backbone = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (linear weights may be stored narrower: model.weight_dtype)."""
        return self.backbone.norm_f.weight.dtype

    @property
    def embedding(self) -> nn.Embedding:
        return self.backbone.embeddings

    def set_embedding(self, table: nn.Embedding) -> None:
        """Replace the embedding table (nn.Module's setattr would register a new module)."""
        self.backbone.embeddings = table

    @property
    def layer_list(self) -> nn.ModuleList:
        return self.backbone.layers

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm_f(h)
