"""One pipeline stage of a NemotronH model: a contiguous range of global layers, plus the
embeddings on the first stage and the final norm + LM head on the last.

    pattern  M M M * - M * -      partition [3, 3, 2]
    stage    0 0 0 1 1 1 2 2      stage 0 attention-free (no KV pool), stage 2 Mamba-free

Module names are the full model's (`backbone.layers.{i}.*` with global i), so a stage loads
its tensors straight from the checkpoint and skips the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.model.hybrid import HybridStage
from baton.model.layers.norms import RMSNorm
from baton.model.nemotron_h.config import ModelConfig
from baton.model.nemotron_h.model import Block


class _Layers(nn.Module):
    """Holds `backbone.layers.{i}` for the stage's global ids i (a ModuleDict keyed by id)."""

    def __init__(self, cfg: ModelConfig, layers: range):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in layers})


class StageModel(HybridStage):
    def __init__(self, config: ModelConfig, layers: range, first: bool, last: bool):
        super().__init__(config, layers, first, last)
        self.backbone = _Layers(config, layers)
        if first:
            self.backbone.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if last:
            self.backbone.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def layer_dict(self) -> nn.ModuleDict:
        return self.backbone.layers

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.layers[str(self.layer_ids[0])].norm.weight.dtype

    @property
    def embedding(self) -> nn.Embedding:
        return self.backbone.embeddings

    def set_embedding(self, table: nn.Embedding) -> None:
        """Replace the embedding table (nn.Module's setattr would register a new module)."""
        self.backbone.embeddings = table

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm_f(h)
