"""The published weight encodings, decoded exactly into float32 (pure functions on tensors).

    fp8_block     Qwen fine-grained FP8: w = fp32(q) * s, one scale per [bn, bk] tile of the
                  last two dims; edge tiles partial (a scale repeated, then cut to N and K)
    fp8_scaled    FP8 times a per-tensor ([] / [1]) or per-output-channel ([N] / [N, 1]) scale
                  (ModelOpt FP8, compressed-tensors FP8)
    nvfp4         ModelOpt NVFP4: uint8 [N, K/2], column 2j in the low nibble and 2j+1 in the
                  high one; e2m1 value * e4m3 scale per 16 columns * fp32 `weight_scale_2`
    nvfp4_ct      compressed-tensors NVFP4 (`nvfp4-pack-quantized`): the same bytes and e4m3
                  scales, divided by the fp32 `weight_global_scale` (w = e2m1 * (s / g), the
                  package's `dequantize` order)
    int_grouped   compressed-tensors integer weights: (q - zp) * scale, per channel or per group
                  of columns (the last group may be partial)
    unpack_int32  compressed-tensors `pack_quantized`: bits [b*i, b*i+b) of the packed row hold
                  element i, stored + 2^(b-1)

Every product is taken in float32 (the exact reference transformers also uses) and rounds once.
Callers check shapes first (`baton.model.quant.scheme`); these functions assume them.
"""

from __future__ import annotations

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], device="cpu")
# (device named: this module may first be imported while a model is built on the meta device)
"""NVFP4's 16 codes: bits 0-2 the magnitude, bit 3 the sign."""
NVFP4_GROUP = 16

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _pairs() -> torch.Tensor:
    """[256, 2]: a byte's two e2m1 values, low nibble first."""
    b = torch.arange(256, device="cpu")
    return torch.stack((E2M1[b & 0xF], E2M1[b >> 4]), dim=-1)


E2M1_PAIRS = _pairs()


def _expand(scale: torch.Tensor, sizes: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A per-tile scale grid [..., ceil(N/bn), ceil(K/bk)] repeated to [..., N, K]."""
    n, k = sizes
    s = scale.to(torch.float32)
    s = s.repeat_interleave(block[0], dim=-2)[..., :n, :]
    return s.repeat_interleave(block[1], dim=-1)[..., :k]


def fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape[-2:]
    (bn, bk), s = block, scale.to(torch.float32)
    if n % bn == 0 and k % bk == 0:  # whole tiles: one multiply, no expanded scale
        tiles = q.to(torch.float32).unflatten(-1, (k // bk, bk)).unflatten(-3, (n // bn, bn))
        return (tiles * s[..., :, None, :, None]).flatten(-4, -3).flatten(-2)
    return q.to(torch.float32) * _expand(s, (n, k), block)


def fp8_scaled(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.to(torch.float32)
    s = s.reshape(()) if s.numel() == 1 else s.reshape(q.shape[:-1] + (1,))
    return q.to(torch.float32) * s


def nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8)
    vals = E2M1_PAIRS.to(b.device)[b.to(torch.int64)].flatten(-2)  # low nibble first
    groups = vals.unflatten(-1, (-1, NVFP4_GROUP)) * scale.to(torch.float32)[..., None]
    return groups.flatten(-2) * scale_2.to(torch.float32).reshape(())


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` values of each row of `packed` (int32), signed (stored + 2^(b-1))."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit values straddle int32 words")
    if bits in (4, 8):  # whole bytes: the words' little-endian bytes, low nibble first
        b = packed.contiguous().view(torch.uint8)
        if bits == 4:
            b = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
        return b[..., :count].to(torch.int16) - (1 << (bits - 1))
    words = packed.to(torch.int64) & 0xFFFFFFFF
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64, device=packed.device) * bits
    vals = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return vals.flatten(-2)[..., :count] - (1 << (bits - 1))


def int_grouped(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                group: int | None) -> torch.Tensor:
    """(q - zero) * scale; `group` None: one scale per row ([N] / [N, 1]), a number: per
    `group` columns ([N, ceil(K/g)])."""
    k = q.shape[-1]
    s = scale.to(torch.float32)
    z = None if zero is None else zero.to(torch.float32)
    x = q.to(torch.float32)
    if s.numel() == 1:
        s = s.reshape(())
        z = None if z is None else z.reshape(())
    elif group is None:
        s = s.reshape(q.shape[:-1] + (1,))
        z = None if z is None else z.reshape(q.shape[:-1] + (1,))
    elif k % group == 0:  # whole groups: broadcast over a [.., G, group] view
        g = x.unflatten(-1, (k // group, group))
        g = g if z is None else g - z[..., None]
        return (g * s[..., None]).flatten(-2)
    else:
        s = s.repeat_interleave(group, dim=-1)[..., :k]
        z = None if z is None else z.repeat_interleave(group, dim=-1)[..., :k]
    return (x if z is None else x - z) * s


def nvfp4_ct(q: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    b = q.view(torch.uint8)
    vals = E2M1_PAIRS.to(b.device)[b.to(torch.int64)].flatten(-2)  # low nibble first
    s = scale.to(torch.float32) / global_scale.to(torch.float32).reshape(())
    return (vals.unflatten(-1, (-1, NVFP4_GROUP)) * s[..., None]).flatten(-2)
