"""Gated full attention with partial rotary embeddings (Qwen3.5's `self_attn`) over paged KV.

    q_proj -> per head [ q (hd) | gate (hd) ]      k_proj, v_proj -> kv heads
    q, k: zero-centred RMSNorm over hd, then partial rotary (first rotary_dim dims,
          rotate-half, the checkpoint's rope_theta), at the tokens' positions
    out = o_proj(attention(q, k, v) * sigmoid(gate))
K is stored after norm and rotary, so the pool holds exactly what every later query reads.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.model import paged
from baton.model.layers import fused, linear
from baton.model.layers.gated_norms import ZeroCentredRMSNorm
from baton.model.paged import StepContext


def rotary(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    """(cos, sin) [..., dim] for integer `positions` [...], as transformers builds them."""
    exps = torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim
    inv_freq = 1.0 / (theta ** exps)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, hd]; cos/sin [..., rot] broadcast over heads; dims past rot pass through."""
    rot = cos.shape[-1]
    cos, sin = cos[..., None, :], sin[..., None, :]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    turned = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + turned * sin, xp], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = hd = cfg.head_dim
        self.scale = hd**-0.5
        self.rotary_dim, self.theta = cfg.rotary_dim, cfg.rope_theta
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, cfg.rms_norm_eps)

    def prefill(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x [n, T, hidden]: T tokens of each of n sequences at ctx.attn.positions [n, T]."""
        n, T, _ = x.shape
        q, gate, k, v = self._project(x, ctx.attn)
        rows = self._store_and_read(k, v, n, ctx)
        out = fused.prefill_attention_rows(self.scale, q, rows, ctx.kv(self.layer_idx),
                                           ctx.attn).reshape(n, T, -1)
        return self.o_proj(out * torch.sigmoid(gate))

    def decode(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x [b, hidden], one token of each of b sequences at ctx.attn.positions [b]."""
        b, rep = x.shape[0], self.num_heads // self.num_kv_heads
        q, gate, k, v = self._project(x, ctx.attn)
        pool = ctx.kv(self.layer_idx)
        if fused.fast_decoding(x) and fused.paged_fast(pool):
            out = fused.paged_attention(self.scale, q, k, v, pool, ctx.attn)
            return self.o_proj(out * torch.sigmoid(gate))
        keys, values = paged.dequantize(self._store_and_read(k, v, b, ctx), self.head_dim)
        S, hd = ctx.attn.num_keys, self.head_dim
        q = q.reshape(b * self.num_kv_heads, rep, hd)
        scores = torch.bmm(q, keys.to(q.dtype).view(-1, S, hd).transpose(1, 2))
        scores = scores.mul_(self.scale).view(b, self.num_heads, S)
        probs = torch.softmax(scores + ctx.attn.mask, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs.view(-1, rep, S), values.to(q.dtype).view(-1, S, hd))
        return self.o_proj(out.view(b, -1) * torch.sigmoid(gate))

    def _project(self, x: torch.Tensor, meta):
        """(q [..., heads, hd], gate [..., heads*hd], k, v [..., kv_heads, hd]) of x [..., hidden]
        at the call's positions (`meta`: its AttnMeta)."""
        lead, hd = x.shape[:-1], self.head_dim
        qkv = linear.fused_linears(x, self.q_proj, self.k_proj, self.v_proj)  # fast decode
        q, k, v = qkv if qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, gate = q.view(*lead, self.num_heads, 2 * hd).chunk(2, dim=-1)
        k = self.k_norm(k.view(*lead, self.num_kv_heads, hd))
        v = v.view(*lead, self.num_kv_heads, hd)
        cos, sin = self.rotary(x, meta)
        q = apply_rotary(self.q_norm(q), cos, sin)
        return q, gate.reshape(*lead, -1), apply_rotary(k, cos, sin), v

    def rotary(self, x: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [..., rotary_dim] at the call's positions: the same for every attention
        layer of the call, computed by the first (kept in `meta.memo`)."""
        key = ("rotary", self.rotary_dim, self.theta, x.dtype, x.device)
        if key not in meta.memo:
            meta.memo[key] = rotary(meta.positions.to(x.device), self.rotary_dim, self.theta,
                                    x.dtype)
        return meta.memo[key]

    def _store_and_read(self, k: torch.Tensor, v: torch.Tensor, b: int,
                        ctx: StepContext) -> torch.Tensor:
        """Write the new tokens' K/V, then gather their rows as the pool stores them: [2 (K, V),
        b, kv_heads, keys, row] (read back even for fresh tokens, so a resumed prefill sees
        what a one-shot one saw; `paged.dequantize` widens them)."""
        meta, pool = ctx.attn, ctx.kv(self.layer_idx)
        width = self.num_kv_heads * self.head_dim
        paged.store_kv(pool, meta.write_rows, k.reshape(-1, width), v.reshape(-1, width))
        kv = paged.gather_kv(pool, meta.read_rows)
        return kv.view(2, b, self.num_kv_heads, meta.num_keys, -1)
