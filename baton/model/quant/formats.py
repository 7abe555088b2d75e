"""The published weight encodings, decoded exactly into float32 (pure functions on tensors).

    fp8_block     Qwen fine-grained FP8: w = fp32(q) * s, one scale per [bn, bk] tile of the
                  last two dims; edge tiles partial (a scale repeated, then cut to N and K)
    fp8_scaled    FP8 times a per-tensor ([] / [1]) or per-output-channel ([N] / [N, 1]) scale
                  (ModelOpt FP8, compressed-tensors FP8)
    nvfp4         ModelOpt NVFP4: uint8 [N, K/2], column 2j in the low nibble and 2j+1 in the
                  high one; e2m1 value * e4m3 scale per 16 columns * fp32 `weight_scale_2`
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


def _expand(scale: torch.Tensor, sizes: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A per-tile scale grid [..., ceil(N/bn), ceil(K/bk)] repeated to [..., N, K]."""
    n, k = sizes
    s = scale.to(torch.float32)
    s = s.repeat_interleave(block[0], dim=-2)[..., :n, :]
    return s.repeat_interleave(block[1], dim=-1)[..., :k]


def fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    return q.to(torch.float32) * _expand(scale, tuple(q.shape[-2:]), block)


def fp8_scaled(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.to(torch.float32)
    s = s.reshape(()) if s.numel() == 1 else s.reshape(q.shape[:-1] + (1,))
    return q.to(torch.float32) * s


def nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)  # low nibble first
    vals = E2M1.to(b.device)[codes]
    per_group = scale.to(torch.float32).repeat_interleave(NVFP4_GROUP, dim=-1)
    return vals * per_group * scale_2.to(torch.float32).reshape(())


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` values of each row of `packed` (int32), signed (stored + 2^(b-1))."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    per_word = 32 // bits
    if 32 % bits:
        raise ValueError(f"{bits}-bit values straddle int32 words")
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
    if s.numel() == 1:
        s = s.reshape(())
        z = None if z is None else z.reshape(())
    elif group is None:
        s = s.reshape(q.shape[:-1] + (1,))
        z = None if z is None else z.reshape(q.shape[:-1] + (1,))
    else:
        s = s.repeat_interleave(group, dim=-1)[..., :k]
        z = None if z is None else z.repeat_interleave(group, dim=-1)[..., :k]
    x = q.to(torch.float32)
    return (x if z is None else x - z) * s
