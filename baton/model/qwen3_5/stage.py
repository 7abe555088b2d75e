"""One pipeline stage of a Qwen3.5 model: a contiguous range of global layers, plus the
embeddings on the first stage and the final norm + LM head on the last.

    pattern  G G G * G G G *      partition [3, 5]
    stage    0 0 0 1 1 1 1 1      stage 0 attention-free (no KV pool)

Module names are the full model's (`model.layers.{i}.*` with global i), so a stage loads its
tensors straight from the checkpoint and skips the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.model.hybrid import HybridStage
from baton.model.layers.gated_norms import ZeroCentredRMSNorm
from baton.model.qwen3_5.config import Qwen35Config
from baton.model.qwen3_5.model import DecoderLayer


class _Layers(nn.Module):
    """Holds `model.layers.{i}` for the stage's global ids i (a ModuleDict keyed by id)."""

    def __init__(self, cfg: Qwen35Config, layers: range):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in layers})


class Qwen35Stage(HybridStage):
    def __init__(self, config: Qwen35Config, layers: range, first: bool, last: bool):
        super().__init__(config, layers, first, last)
        self.model = _Layers(config, layers)
        if first:
            self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if last:
            self.model.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def layer_dict(self) -> nn.ModuleDict:
        return self.model.layers

    @property
    def dtype(self) -> torch.dtype:
        return self.model.layers[str(self.layer_ids[0])].post_attention_layernorm.weight.dtype

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_embedding(self, table: nn.Embedding) -> None:
        """Replace the embedding table (nn.Module's setattr would register a new module)."""
        self.model.embed_tokens = table

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)
