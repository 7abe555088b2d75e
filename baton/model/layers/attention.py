"""GQA self-attention without positional encoding, over paged KV (NemotronH's `*` layers)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from baton.model import paged
from baton.model.layers import fused, linear
from baton.model.paged import StepContext


class AttentionDims(Protocol):
    """What the layer reads of a model config (any family's)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


class Attention(nn.Module):
    def __init__(self, cfg: AttentionDims, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # transformers builds these without bias whatever `attention_bias` says; so do we.
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=False)

    def prefill(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x [n, T, hidden]: T tokens of each of n sequences."""
        n, T, _ = x.shape
        q = self.q_proj(x).view(n, T, self.num_heads, self.head_dim)
        rows = self._store_and_read(x.reshape(n * T, -1), n, ctx)
        out = fused.prefill_attention_rows(self.scale, q, rows, ctx.kv(self.layer_idx), ctx.attn)
        return self.o_proj(out.reshape(n, T, -1))

    def decode(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x [b, hidden], one token of each of b sequences.

        One query per sequence: two batched matmuls over (sequence, kv head) beat SDPA's
        masked kernel here, and need no repeat of K/V for the GQA group.
        """
        b, rep = x.shape[0], self.num_heads // self.num_kv_heads
        if fused.fast_decoding(x) and fused.paged_fast(ctx.kv(self.layer_idx)):
            qkv = linear.fused_linears(x, self.q_proj, self.k_proj, self.v_proj)
            q, k, v = qkv if qkv is not None else (self.q_proj(x), self.k_proj(x),
                                                   self.v_proj(x))
            q = q.reshape(b, self.num_heads, self.head_dim)
            return self.o_proj(fused.paged_attention(self.scale, q, k, v,
                                                     ctx.kv(self.layer_idx), ctx.attn))
        q = self.q_proj(x).view(b * self.num_kv_heads, rep, self.head_dim)
        keys, values = paged.dequantize(self._store_and_read(x, b, ctx), self.head_dim)
        S = ctx.attn.num_keys
        keys = keys.to(q.dtype).view(-1, S, self.head_dim)
        scores = torch.bmm(q, keys.transpose(1, 2)).mul_(self.scale).view(b, self.num_heads, S)
        # Padding keys get -inf, so they weigh exactly 0 and a batch matches each sequence alone.
        probs = torch.softmax(scores + ctx.attn.mask, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs.view(-1, rep, S), values.to(q.dtype).view(-1, S, self.head_dim))
        return self.o_proj(out.view(b, -1))

    def store_kv(self, x: torch.Tensor, ctx: StepContext) -> None:
        """Only the K/V of decode rows x [b, hidden] at `ctx.attn.write_rows` (no query, no
        attention): the same bits `decode` writes on either path (the kernel's projections
        give a row's k and v alike alone, together or beside q)."""
        kv = linear.fused_linears(x, self.k_proj, self.v_proj)
        k, v = kv if kv is not None else (self.k_proj(x), self.v_proj(x))
        paged.store_kv(ctx.kv(self.layer_idx), ctx.attn.write_rows, k, v)

    def _store_and_read(self, x: torch.Tensor, b: int, ctx: StepContext) -> torch.Tensor:
        """Write the K/V of tokens x [n, hidden], then gather their rows as the pool stores
        them: [2 (K, V), b, kv_heads, keys, row] (`paged.dequantize` widens them).

        Keys are read back from the pool even for fresh tokens, so a resumed prefill sees
        exactly the values (same dtype rounding) that a one-shot prefill saw.
        """
        meta, pool = ctx.attn, ctx.kv(self.layer_idx)
        paged.store_kv(pool, meta.write_rows, self.k_proj(x), self.v_proj(x))
        kv = paged.gather_kv(pool, meta.read_rows)
        return kv.view(2, b, self.num_kv_heads, meta.num_keys, -1)
