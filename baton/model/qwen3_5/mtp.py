"""Qwen3.5 multi-token-prediction head, as published: `mtp.*`.

Config: `mtp_num_hidden_layers` (top level or in `text_config`; 0 / absent = none). One step
(applied K times for K drafts, layer `k % mtp_num_hidden_layers` at draft k; Baton applies
layer 0 for every draft, which is the published one-layer head exactly):

    x   = fc(cat[pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])
    x  += self_attn(input_layernorm(x))        a gated full-attention layer (q/k norm, rotary)
    x  += mlp(post_attention_layernorm(x))
    out = norm(x) -> the target's lm_head; out is the next draft step's hidden

Names: `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
`mtp.layers.0.{input_layernorm,self_attn.*,post_attention_layernorm,mlp.*}`, `mtp.norm`
(all RMSNorms zero-centred, `1 + w`). The attention layer's global id is `num_layers`; its
KV sits in the target's pool beside the target's layers (see baton/model/nemotron_h/mtp.py).
"""

from __future__ import annotations

import torch
from torch import nn

from baton.model.layers import fast_decode
from baton.model.layers.gated_attention import GatedAttention
from baton.model.layers.gated_mlp import GatedMLP
from baton.model.layers.gated_norms import ZeroCentredRMSNorm
from baton.model.paged import StepContext
from baton.model.pools import Pools, PoolSpec


def qwen_mtp_layers(cfg) -> int:
    raw = getattr(cfg, "raw", {}) or {}
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    return int(raw.get("mtp_num_hidden_layers") or text.get("mtp_num_hidden_layers") or 0)


def build_head(cfg) -> Qwen35MTPHead | None:
    """The MTP head `cfg` declares, or None (the family's `mtp`)."""
    n = qwen_mtp_layers(cfg)
    return Qwen35MTPHead(cfg, n) if n else None


class Qwen35MTPLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GatedAttention(cfg, layer_idx)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)


def _parts(layer: Qwen35MTPLayer) -> list:
    """The layer's two parts for `fast_decode` (as `qwen3_5.model.qwen_parts`)."""
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    return [(n1._scale(), n1.eps, n1.weight, layer.self_attn, True),
            (n2._scale(), n2.eps, n2.weight, layer.mlp, False)]


class Qwen35MTPHead(nn.Module):
    def __init__(self, cfg, num_layers: int):
        super().__init__()
        self.cfg = cfg
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(H, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(H, eps)
        self.layers = nn.ModuleList(Qwen35MTPLayer(cfg, cfg.num_layers + i)
                                    for i in range(num_layers))
        self.norm = ZeroCentredRMSNorm(H, eps)

    @property
    def declared(self) -> str:
        """What the config declares, for errors."""
        return f"mtp_num_hidden_layers={len(self.layers)}"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return (self.cfg.num_layers,)  # layer 0 (every draft step applies it)

    def make_pools(self, target: PoolSpec) -> Pools:
        return Pools(PoolSpec.kv_beside(target, self.attention_layers, self.cfg))

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, embed: nn.Embedding,
                lm_head: nn.Linear, ctx: StepContext, decode: bool, logits: bool = True):
        """As `baton.model.nemotron_h.mtp.MTPHead.forward` (rows [R, H] with decode_meta, or [n, T, H]
        with prefill_meta, whose positions drive the rotary embedding)."""
        e = self.pre_fc_norm_embedding(embed(next_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        layer = self.layers[0]
        # decode rows on the fast path: the layer in one call of plain decode's kernels
        y = fast_decode.program_only(self.layers, x, ctx, _parts) \
            if decode and len(self.layers) == 1 else None
        if y is not None:
            x = y
        else:
            y = layer.input_layernorm(x)
            x = x + (layer.self_attn.decode(y, ctx) if decode else
                     layer.self_attn.prefill(y, ctx))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = self.norm(x)
        return out, lm_head(out).float() if logits else None

    def write_kv(self, hidden: torch.Tensor, next_ids: torch.Tensor, embed: nn.Embedding,
                 ctx: StepContext) -> None:
        """Only the head's KV entries of decode rows hidden [R, H]: its pass without the LM
        head (the attention layer comes first, so nothing is left to skip)."""
        self(hidden, next_ids, embed, None, ctx, decode=True, logits=False)
