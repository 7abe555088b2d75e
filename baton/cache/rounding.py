"""Rounding float32 state to a narrower stored dtype: nearest, or stochastic keyed by position.

Stochastic rounding (SR) stores x as one of its two neighbours in the target dtype, `down`
(toward zero) or `up` (away from zero), rounding up with probability

    frac = (|x| - |down|) / (|up| - |down|)        (the fractional part, in target ulps)

so the stored value is unbiased. The random draw for an element is a counter-based hash of
a 64-bit *stream key* and the element's index inside its state tensor: no generator, no
global RNG state, nothing that depends on the slot, the batch row, the call order or the
thread count. The stream key names what is stored, never where:

    stream_key = blake2b8(seed | prefix_hash | position | layer | tensor name)
    draw(i)    = fmix32(fmix32(fmix32(i_lo ^ k_lo) ^ k_hi) ^ i_hi ^ golden)   (24 top bits)

`prefix_hash` is the token prefix's snapshot hash (`baton.contract.prefix_hash`), which
already includes the position; `position` is also hashed so callers without a prefix hash
(tests, benches) still key by position. So a state stored from two slots, two batches or
two workers gives the same bytes, and a restored snapshot equals the uninterrupted run's
state at that position.

All integer arithmetic runs in int64 on values below 2**49 (32-bit multiplies split in
16-bit halves), so it never overflows on any device; the comparison runs in float32 with
24-bit draws, which is exact whenever `frac` has at most 24 fractional bits (every
float32 -> bfloat16 case and every normal float32 -> float16 case; tiny float16
subnormal targets carry a bias below 2**-24). Finite inputs saturate at the target's
largest finite value (never round up to inf); inf and nan are stored as nearest does.
"""

from __future__ import annotations

import hashlib
import struct

import torch

ROUNDINGS = ("nearest", "stochastic")
"""Values of `cache.state_rounding`."""
TARGETS = {"bfloat16": torch.bfloat16, "float16": torch.float16}
"""Narrow dtypes a float32 state may be stored in (16-bit: neighbours are +-1 in the bits)."""

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_DRAW_BITS = 24


def stream_key(seed: int, prefix_hash: int, position: int, layer: int, tensor: str) -> int:
    """The 64-bit key (as a signed int64 value) of one stored state tensor of one layer."""
    blob = struct.pack("<QQQq", seed & (2**64 - 1), prefix_hash & (2**64 - 1), position,
                       layer) + tensor.encode()
    u = int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")
    return u - 2**64 if u >= 2**63 else u


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for 0 <= a < 2**32, without int64 overflow."""
    lo = a * (c & 0xFFFF)
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection with full avalanche)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def draws(keys: torch.Tensor, shape: tuple[int, ...], index: torch.Tensor | None = None
          ) -> torch.Tensor:
    """Uniform integers in [0, 2**24), shape `keys.shape + shape`: row r's element i (flat
    index in `shape`, or `index[i]`: a tensor-parallel shard's elements numbered as in the
    whole TP 1 tensor) depends only on (keys[r], i)."""
    keys = keys.to(torch.int64)
    if index is not None:
        idx = index.to(device=keys.device, dtype=torch.int64).view(shape)
    else:
        numel = 1
        for n in shape:
            numel *= n
        idx = torch.arange(numel, dtype=torch.int64, device=keys.device).view(shape)
    k = keys.reshape(*keys.shape, *([1] * len(shape)))
    k_lo, k_hi = k & _M32, (k >> 32) & _M32
    h = _fmix32((idx & _M32) ^ k_lo)
    h = _fmix32(h ^ k_hi)
    h = _fmix32(h ^ ((idx >> 32) & _M32) ^ _GOLDEN)
    return h >> (32 - _DRAW_BITS)


def round_nearest(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest-even (torch's own conversion)."""
    return x.to(dtype)


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, keys: torch.Tensor,
                     index: torch.Tensor | None = None) -> torch.Tensor:
    """Stochastically round float32 `x` [*keys.shape, *state_shape] to `dtype`, draws keyed
    per leading row by `keys` (see `stream_key`) and by element index in the trailing dims."""
    if dtype not in TARGETS.values():
        raise ValueError(f"stochastic rounding targets {sorted(TARGETS)}, not {dtype}")
    if x.dtype != torch.float32:
        raise ValueError(f"stochastic rounding reads float32, not {x.dtype}")
    if tuple(x.shape[: keys.dim()]) != tuple(keys.shape):
        raise ValueError(f"keys shape {list(keys.shape)} is not the leading dims of "
                         f"{list(x.shape)}")
    if dtype == torch.bfloat16 and x.device.type == "cpu":
        from baton.cache.round_kernel import kernel

        k = kernel()  # the fused kernel: the same bits in one pass (about 60x less CPU)
        if k is not None:
            flat = index.reshape(-1) if index is not None else torch.empty(0, dtype=torch.int64)
            return k.round_bf16_stochastic(x.contiguous(), keys.reshape(-1), flat)
    r = draws(keys.to(x.device), tuple(x.shape[keys.dim():]), index)
    if dtype == torch.bfloat16:
        return _bf16_stochastic(x, r)
    return _neighbours_stochastic(x, dtype, r)


def _neighbours_stochastic(x: torch.Tensor, dtype: torch.dtype, r: torch.Tensor) -> torch.Tensor:
    """Any 16-bit target: the two neighbours from the nearest result +-1 in the bits, rounding
    up iff the draw r (24 bits) < frac * 2**24."""
    y = x.to(dtype)
    ax, ay = x.abs(), y.float().abs()
    bits = y.view(torch.int16)
    away = ay > ax  # nearest went up: neighbours are (y - 1 ulp, y)
    down = torch.where(away, bits - 1, bits).view(dtype)
    up = torch.where(away, bits, bits + 1).view(dtype)
    adown = down.float().abs()
    frac = (ax - adown) / (up.float().abs() - adown)  # exact: power-of-two gap
    round_up = r.to(torch.float32) < frac * float(2**_DRAW_BITS)
    finite_up = torch.isfinite(up.float())  # else: saturate at the largest finite value
    out = torch.where(round_up & finite_up, up, down)
    return torch.where(torch.isfinite(x), out, y)  # inf and nan: as nearest stores them


def _bf16_stochastic(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The bfloat16 case in fewer passes: bfloat16 is float32's upper half, so adding 16
    random bits below it and truncating rounds up with probability low16 / 2**16 = frac.
    Adding 0xFFFF - r16 rounds up iff r16 < low16: the same decision, hence the same bytes,
    as the general path (`draw < frac * 2**24` with a 16-bit frac)."""
    bits = x.view(torch.int32)
    add = (0xFFFF - (r >> (_DRAW_BITS - 16))).to(torch.int32)
    up = ((bits + add) & -0x10000).view(torch.float32)  # finite x: no int32 overflow
    out = up.to(torch.bfloat16)  # exact: the low half is zero
    big = torch.finfo(torch.bfloat16).max
    out = torch.where(torch.isinf(out), torch.copysign(torch.tensor(big, dtype=torch.bfloat16,
                                                                    device=x.device), out), out)
    return torch.where(torch.isfinite(x), out, x.to(torch.bfloat16))


def round_state(x: torch.Tensor, dtype: torch.dtype, rounding: str,
                keys: torch.Tensor | None = None, index: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Store float32 `x` as `dtype` with `rounding` ("nearest" or "stochastic"; stochastic
    needs `keys`). float32 targets (and x already in `dtype`) are returned unchanged."""
    if dtype == x.dtype:
        return x
    if rounding == "nearest" or dtype not in TARGETS.values():
        return round_nearest(x, dtype)
    if rounding != "stochastic":
        raise ValueError(f"rounding {rounding!r} is not one of {list(ROUNDINGS)}")
    if keys is None:
        raise ValueError("stochastic rounding needs stream keys (see stream_key)")
    return round_stochastic(x, dtype, keys, index)
