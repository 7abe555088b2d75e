"""Qwen3.5's trainable MTP head (`TrainRecipe.mtp_head`, baton/train) with the published
parameter names (`mtp.*`, as baton/model/qwen3_5/mtp.py loads them). transformers builds no
MTP head, so it is written here, over the target's embedding and LM head:

    x = fc(cat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h)])
    x = transformers' Qwen3_5DecoderLayer (full attention)(x); out = norm(x)

h is the target's hidden after its final norm at position i; the head predicts token i+2.
"""

from __future__ import annotations

import torch
from torch import nn


def build(lm, config: dict) -> nn.Module:
    """The head of transformers' causal LM `lm` (its rotary embedding shared)."""
    return Qwen35MTP(lm.config, lm.model.rotary_emb)


class Qwen35MTP(nn.Module):
    def __init__(self, c, rotary):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5DecoderLayer,
            Qwen3_5RMSNorm,
        )

        H, eps = c.hidden_size, c.rms_norm_eps
        attn = c.layer_types.index("full_attention")
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(c, attn)])
        self.norm = Qwen3_5RMSNorm(H, eps=eps)
        self._rotary = [rotary]  # the target's (not a parameter of the head)

    def forward(self, hidden, next_ids, embed, position_ids=None):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embed(next_ids)),
                               self.pre_fc_norm_hidden(hidden)], -1))
        B, T, _ = x.shape
        pos = torch.arange(T).view(1, 1, T).expand(3, B, T)
        x = self.layers[0](x, position_embeddings=self._rotary[0](x, pos))
        return self.norm(x)
