"""Qwen3.5 causal LM over Baton's paged pools: its decoder layers (a DeltaNet or gated
attention mixer, then a SwiGLU or MoE feed-forward) in `baton.model.hybrid.HybridLM`.

Module names mirror transformers' `Qwen3_5ForCausalLM` (`model.layers.{i}.linear_attn.*`,
`model.layers.{i}.self_attn.*`, `model.embed_tokens`, `model.norm`, `lm_head`), so a checkpoint
loads unchanged (the multimodal layout's `model.language_model.` prefix is mapped by the loader).
"""

from __future__ import annotations

import torch
from torch import nn

from baton.model.hybrid import HybridLM
from baton.model.layers.deltanet import GatedDeltaNet
from baton.model.layers.gated_attention import GatedAttention
from baton.model.layers.gated_norms import ZeroCentredRMSNorm
from baton.model.layers.softmax_moe import feed_forward
from baton.model.paged import StepContext
from baton.model.protocol import Mix
from baton.model.qwen3_5.config import Qwen35Config


class DecoderLayer(nn.Module):
    """x += mixer(norm(x)); x += mlp(norm(x)); the mixer is `linear_attn` or `self_attn`."""

    def __init__(self, cfg: Qwen35Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.pattern[layer_idx] == "G":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx)
        self.mlp = feed_forward(cfg, layer_idx)  # SwiGLU, or the MoE block (MoE families)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def forward(self, h: torch.Tensor, ctx: StepContext, decode: bool) -> torch.Tensor:
        x, mixer = self.input_layernorm(h), self.mixer
        h = h + (mixer.decode(x, ctx) if decode else mixer.prefill(x, ctx))
        return h + self.mlp(self.post_attention_layernorm(h))

    def run_mixed(self, h: torch.Tensor, mix: Mix) -> torch.Tensor:
        h = h + mix(self.mixer, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


def qwen_parts(layer: DecoderLayer):
    """A `DecoderLayer`'s two parts for `fast_decode` (norm weight as the kernel reads it,
    eps, watched norm weight, module, is mixer)."""
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    return [(n1._scale(), n1.eps, n1.weight, layer.mixer, True),
            (n2._scale(), n2.eps, n2.weight, layer.mlp, False)]


class TextModel(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35Model(HybridLM):
    state_kind = "DeltaNet"
    fast_parts = staticmethod(qwen_parts)

    def __init__(self, config: Qwen35Config):
        super().__init__()
        self.config = config
        self.mtp: nn.Module | None = None
        """The MTP head, when the checkpoint has one (`baton.model.loader.attach_mtp`)."""
        self.model = TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_embedding(self, table: nn.Embedding) -> None:
        """Replace the embedding table (nn.Module's setattr would register a new module)."""
        self.model.embed_tokens = table

    @property
    def layer_list(self) -> nn.ModuleList:
        return self.model.layers

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)
