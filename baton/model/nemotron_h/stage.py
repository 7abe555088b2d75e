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

from baton.model.layers.norms import RMSNorm
from baton.model.nemotron_h.config import ModelConfig
from baton.model.nemotron_h.model import Block
from baton.model.paged import StepContext


class _Layers(nn.Module):
    """Holds `backbone.layers.{i}` for the stage's global ids i (a ModuleDict keyed by id)."""

    def __init__(self, cfg: ModelConfig, layers: range):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in layers})


class StageModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: range, first: bool, last: bool):
        super().__init__()
        self.config, self.layer_ids, self.first, self.last = config, layers, first, last
        self.mtp: nn.Module | None = None
        """The MTP head on a speculating worker's last stage (`loader.load_stage`)."""
        self.backbone = _Layers(config, layers)
        if first:
            self.backbone.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if last:
            self.backbone.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def param(self) -> torch.Tensor:
        return next(self.parameters())

    @property
    def device(self) -> torch.device:
        return self.param.device

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.layers[str(self.layer_ids[0])].norm.weight.dtype

    @property
    def embedding(self) -> nn.Embedding:
        return self.backbone.embeddings

    def blocks(self) -> list[nn.Module]:
        return list(self.backbone.layers.values())

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm_f(h)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(ids.to(self.device))

    def run_layers(self, h: torch.Tensor, ctx: StepContext, decode: bool) -> torch.Tensor:
        for block in self.backbone.layers.values():
            h = block(h, ctx, decode)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of the final hidden states `h` (last stage only)."""
        return self.lm_head(self.backbone.norm_f(h)).float()
