"""Prefill FLOPs per token of each layer kind (multiply-add = 2 FLOPs; d = the hidden size),
from which a config's `prefill_flops()` sums its layers (baton/cache/value.py ranks cached
snapshots by the FLOPs a hit saves). Torch-free: configs call it.

    recurrent (Mamba2, gated DeltaNet)  projections + conv + state update, per token
    attention                           projections per token, plus 2 * H * hd * (n^2 - p^2)
                                        over tokens [p, n) (the `quadratic` term)
    MLP                                 2 * d * I * (2, or 3 when gated)
    MoE                                 router + top_k experts + shared expert
"""

from __future__ import annotations


def mamba2(d: int, heads: int, head_dim: int, groups: int, state: int, conv_kernel: int) -> int:
    inner, gn = heads * head_dim, groups * state
    return (2 * d * (2 * inner + 2 * gn + heads) + 2 * inner * d
            + 2 * (inner + 2 * gn) * conv_kernel + 6 * inner * state)


def gated_deltanet(d: int, key_heads: int, key_dim: int, value_heads: int,
                   value_dim: int) -> int:
    qk, v = key_heads * key_dim, value_heads * value_dim
    return (2 * d * (2 * qk + 2 * v + 2 * value_heads) + 2 * v * d
            + 6 * value_heads * key_dim * value_dim)


def attention(d: int, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(per token, the position term's coefficient)."""
    return 2 * d * (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim * d, \
        2 * heads * head_dim


def mlp(d: int, inter: int, gated: bool) -> int:
    return 2 * d * inter * (3 if gated else 2)


def moe(d: int, experts: int, top_k: int, inter: int, shared_inter: int) -> int:
    """A router over `experts`, `top_k` two-matrix experts and a two-matrix shared expert."""
    return 2 * d * experts + top_k * 4 * d * inter + 4 * d * shared_inter
