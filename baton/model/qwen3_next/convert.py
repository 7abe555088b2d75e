"""Qwen3-Next's interleaved DeltaNet projections rearranged into Qwen3.5's layout at load.

Qwen3-Next stores one projection per key-head group g (HK groups, r = HV / HK value heads each):

    in_proj_qkvz [HK * (2 dk + 2 r dv), H]   rows of group g:  q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)
    in_proj_ba   [HK * 2 r, H]               rows of group g:  b_g (r)  | a_g (r)

transformers splits the projected activations per group and concatenates [q | k | v] before
the conv. Splitting the weight rows the same way once gives Qwen3.5's projections, so the
Qwen3.5 DeltaNet runs Qwen3-Next unchanged:

    in_proj_qkv [2 HK dk + HV dv, H] = [q_0..q_HK-1 | k_0.. | v_0..]    in_proj_z [HV dv, H]
    in_proj_b   [HV, H]                                                 in_proj_a [HV, H]
"""

from __future__ import annotations

import torch


def split_qkvz(w: torch.Tensor, key_heads: int, key_dim: int, value_heads: int,
               value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(in_proj_qkv, in_proj_z) rows from Qwen3-Next's `in_proj_qkvz` weight."""
    r = value_heads // key_heads
    g = w.view(key_heads, 2 * key_dim + 2 * r * value_dim, -1)
    q, k, v, z = torch.split(g, [key_dim, key_dim, r * value_dim, r * value_dim], dim=1)
    hidden = w.shape[-1]
    qkv = torch.cat([t.reshape(-1, hidden) for t in (q, k, v)])
    return qkv.contiguous(), z.reshape(-1, hidden).contiguous()


def split_ba(w: torch.Tensor, key_heads: int, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(in_proj_b, in_proj_a) rows from Qwen3-Next's `in_proj_ba` weight."""
    r = value_heads // key_heads
    b, a = torch.split(w.view(key_heads, 2 * r, -1), [r, r], dim=1)
    hidden = w.shape[-1]
    return b.reshape(-1, hidden).contiguous(), a.reshape(-1, hidden).contiguous()
