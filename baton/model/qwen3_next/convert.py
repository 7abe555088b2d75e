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

from baton.errors import ConfigError


def split_projection(cfg, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The loader's hook: `...linear_attn.in_proj_qkvz.weight` -> `in_proj_qkv` and
    `in_proj_z`; `...in_proj_ba.weight` -> `in_proj_b` and `in_proj_a`."""
    pre = name[: name.rindex(".in_proj_")]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    qkvz = name.endswith(".in_proj_qkvz.weight")
    rows = 2 * cfg.key_dim + 2 * cfg.value_dim if qkvz else 2 * hv
    if w.dim() != 2 or w.shape[0] != rows or w.shape[1] != cfg.hidden_size:
        raise ConfigError(
            f"tensor {name!r} has shape {list(w.shape)} but config.json implies "
            f"{[rows, cfg.hidden_size]}: the checkpoint and its config.json disagree"
        )
    if qkvz:
        qkv, z = split_qkvz(w, hk, cfg.linear_key_head_dim, hv, cfg.linear_value_head_dim)
        return {f"{pre}.in_proj_qkv.weight": qkv, f"{pre}.in_proj_z.weight": z}
    b, a = split_ba(w, hk, hv)
    return {f"{pre}.in_proj_b.weight": b, f"{pre}.in_proj_a.weight": a}


def join_projections(cfg, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse, for make-model: Qwen3.5-layout DeltaNet weights back to Qwen3-Next's."""
    out, hk, hv = {}, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    r = hv // hk
    for name, w in state.items():
        if name.endswith(".in_proj_qkv.weight"):
            pre, h = name[: -len(".in_proj_qkv.weight")], w.shape[1]
            q, k, v = torch.split(w, [cfg.key_dim, cfg.key_dim, cfg.value_dim])
            z = state[f"{pre}.in_proj_z.weight"]
            groups = [t.reshape(hk, -1, h) for t in (q, k, v, z)]
            out[f"{pre}.in_proj_qkvz.weight"] = torch.cat(groups, dim=1).reshape(-1, h)
            b, a = state[f"{pre}.in_proj_b.weight"], state[f"{pre}.in_proj_a.weight"]
            ba = torch.cat([b.reshape(hk, r, h), a.reshape(hk, r, h)], dim=1)
            out[f"{pre}.in_proj_ba.weight"] = ba.reshape(-1, h)
        elif not name.endswith((".in_proj_z.weight", ".in_proj_b.weight", ".in_proj_a.weight")):
            out[name] = w
    return out


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
