"""GQA self-attention without positional encoding, over paged KV (NemotronH's `*` layers)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

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
        keys, values = self._store_and_read(x.reshape(n * T, -1), n, ctx)
        out = fused.prefill_attention(self.scale, q, keys, values, ctx.attn)
        return self.o_proj(out.reshape(n, T, -1))

    def decode(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x [b, hidden], one token of each of b sequences.

        One query per sequence: two batched matmuls over (sequence, kv head) beat SDPA's
        masked kernel here, and need no repeat of K/V for the GQA group.
        """
        b, rep = x.shape[0], self.num_heads // self.num_kv_heads
        if fused.fast_decoding(x) and ctx.kv(self.layer_idx).dtype == torch.float32:
            qkv = linear.fused_linears(x, self.q_proj, self.k_proj, self.v_proj)
            q, k, v = qkv if qkv is not None else (self.q_proj(x), self.k_proj(x),
                                                   self.v_proj(x))
            q = q.reshape(b, self.num_heads, self.head_dim)
            return self.o_proj(fused.paged_attention(self.scale, q, k, v,
                                                     ctx.kv(self.layer_idx), ctx.attn))
        q = self.q_proj(x).view(b * self.num_kv_heads, rep, self.head_dim)
        keys, values = self._store_and_read(x, b, ctx)
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
        pool = ctx.kv(self.layer_idx)
        rows, tpb = ctx.attn.write_rows, pool.shape[2]
        tokens = pool.view(-1, self.num_kv_heads * self.head_dim)
        tokens.index_copy_(0, rows, k.reshape(x.shape[0], -1).to(pool.dtype))
        tokens.index_copy_(0, rows + tpb, v.reshape(x.shape[0], -1).to(pool.dtype))

    def _store_and_read(self, x: torch.Tensor, b: int, ctx: StepContext):
        """Write the K/V of tokens x [n, hidden], then gather [b, kv_heads, keys, head_dim] K, V.

        Keys are read back from the pool even for fresh tokens, so a resumed prefill sees
        exactly the values (same dtype rounding) that a one-shot prefill saw.
        """
        meta, pool = ctx.attn, ctx.kv(self.layer_idx)
        self._store(x, ctx)
        kv = pool.view(-1, self.head_dim).index_select(0, meta.read_rows)
        kv = kv.view(2, b, self.num_kv_heads, meta.num_keys, self.head_dim)
        return kv[0], kv[1]

    def _store(self, x: torch.Tensor, ctx: StepContext) -> None:
        """Write the K/V of tokens x [n, hidden] at the call's write rows."""
        meta, pool = ctx.attn, ctx.kv(self.layer_idx)
        tpb = pool.shape[2]
        tokens = pool.view(-1, self.num_kv_heads * self.head_dim)
        tokens.index_copy_(0, meta.write_rows, self.k_proj(x).to(pool.dtype))
        tokens.index_copy_(0, meta.write_rows + tpb, self.v_proj(x).to(pool.dtype))
