"""NemotronH's trainable MTP head (`TrainRecipe.mtp_head`, baton/train) with the published
parameter names (`mtp.*`, as baton/model/nemotron_h/mtp.py loads them). transformers builds
no MTP head, so it is written here, over the target's embedding and LM head:

    x = eh_proj(cat[enorm(embed(t+1)), hnorm(h)])
    x += attn(norm(x)) (no RoPE, GQA, causal); x += mlp(norm(x)) (relu^2), per layer of the
    head's pattern ('*-'); out = final_layernorm(x)

h is the target's hidden after its final norm at position i; the head predicts token i+2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def build(lm, config: dict) -> nn.Module:
    """The head of transformers' causal LM `lm` and its config.json dict."""
    return NemotronHMTP(lm.config, config["mtp_hybrid_override_pattern"])


class _RMSNorm(nn.Module):
    """NemotronH's RMSNorm: x / rms(x) * w, in float32."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.kv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        H = c.hidden_size
        self.q_proj = nn.Linear(H, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, H, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        r = self.heads // self.kv
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class _MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)).square())


class _NemotronLayer(nn.Module):
    def __init__(self, c, kind: str, first: bool, last: bool):
        super().__init__()
        H, eps = c.hidden_size, c.layer_norm_epsilon
        if first:
            self.enorm, self.hnorm = _RMSNorm(H, eps), _RMSNorm(H, eps)
            self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.norm = _RMSNorm(H, eps)
        self.mixer = _Attention(c) if kind == "*" else _MLP(c)
        if last:
            self.final_layernorm = _RMSNorm(H, eps)


class NemotronHMTP(nn.Module):
    def __init__(self, c, pattern: str = "*-"):
        super().__init__()
        n = len(pattern)
        self.layers = nn.ModuleList(_NemotronLayer(c, k, i == 0, i == n - 1)
                                    for i, k in enumerate(pattern))

    def forward(self, hidden, next_ids, embed, position_ids=None):
        first = self.layers[0]
        x = first.eh_proj(torch.cat([first.enorm(embed(next_ids)), first.hnorm(hidden)], -1))
        for layer in self.layers:
            x = x + layer.mixer(layer.norm(x))
        return self.layers[-1].final_layernorm(x)
