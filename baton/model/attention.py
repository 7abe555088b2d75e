"""The `*` layer of NemotronH: GQA self-attention without positional encoding, over paged KV."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.config import ModelConfig
from baton.model.paged import StepContext


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        # transformers builds these without bias whatever `attention_bias` says; so do we.
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=False)

    def prefill(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x [T, hidden] of one sequence."""
        return self._attend(x[None], ctx)[0]

    def decode(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x [B, hidden], one token of each of B sequences."""
        return self._attend(x[:, None], ctx)[:, 0]

    def _attend(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        b, q_len, _ = x.shape
        meta = ctx.attn
        q = self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b * q_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b * q_len, self.num_kv_heads, self.head_dim)
        pool = ctx.kv(self.layer_idx)
        pool[:, 0][meta.write_blocks, meta.write_offsets] = k.to(pool.dtype)
        pool[:, 1][meta.write_blocks, meta.write_offsets] = v.to(pool.dtype)
        # Keys are read back from the pool even for fresh tokens, so a resumed prefill sees
        # exactly the values (same dtype rounding) that a one-shot prefill saw.
        ctx_kv = pool[meta.read_blocks].to(q.dtype)  # [b, nb, 2, tpb, kvh, hd]
        keys = ctx_kv[:, :, 0].reshape(b, -1, self.num_kv_heads, self.head_dim)
        values = ctx_kv[:, :, 1].reshape(b, -1, self.num_kv_heads, self.head_dim)
        keys = keys[:, : meta.num_keys].transpose(1, 2)
        values = values[:, : meta.num_keys].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys,
            values,
            attn_mask=meta.mask,
            is_causal=meta.mask is None,
            scale=self.head_dim**-0.5,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
