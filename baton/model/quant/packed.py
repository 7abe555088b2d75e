"""Quantized weights kept compressed in memory, laid out for Baton's CPU kernels
(`cpu_kernels/gemv_kernels.h`, `kI8` / `kI4`), which read them as stored.

A packed weight is a tensor view with the float weight's shape [..., N, K] (rows contiguous in
K, so every caller that hands `FastLinear._packed()` or an expert stack to the kernels hands
it on unchanged); each row carries its scales just before its first weight:

    int8  dtype int8: K values q, one float32 scale s in the 4 bytes before the row;
          w = float(q) * s                                    (per output channel)
    int4  dtype uint8 (the view's K "elements" cover K / 2 bytes: never read it as a tensor):
          column 2j in the low nibble of byte j, 2j + 1 in the high one, stored + 8; one
          float16 scale per 32 columns, group g's 2 (g + 1) bytes before the row;
          w = float(q - 8) * float(s_g)                        (K % 32 == 0)
    int8g dtype int8 (`kind` "int8g"; llama.cpp's Q8_0 blocks): the values as bytes q + 128
          (q ^ 0x80: the integer path's unsigned operand as stored), each 128 columns (the row
          padded with q = 0 to whole ones) in the integer path's lane order: byte 4 L + b
          holds column 8 L + b, byte 64 + 4 L + b column 8 L + 4 + b (L < 16, b < 4), so
          never read the view as values (`values`); one float16 scale
          per 32 columns (the last group partial where K % 32), group g's 4 + 2 (g + 1) bytes
          before the row; the 4 bytes before the row all 0xFF (the tag that tells it from a
          per-row int8 weight: a float32 scale never has that top byte);
          w = float(q) * float(s_g)       (`model.quantize_embeddings`, and `model.quantize:
          int8` with `model.quantize_activations`)
    int8 / int8g / int4: the first byte of each row's prefix is 1 where the weight takes the
          kernels' integer path (`mark_int_path`, `model.quantize_activations`), else 0.
    fp8   dtype float8_e4m3fn: K values q as the checkpoint stores them; one float32 scale per
          128 columns, group g's 4 (g + 1) bytes before the row (Qwen's 128 x 128 tiles, a
          per-channel or per-tensor scale repeated); w = fp32(q) * s_g
    nvfp4 dtype float4_e2m1fn_x2 (K "elements" over K / 2 bytes, as int4): the checkpoint's
          bytes (column 2j in the low nibble); the float32 tensor scale s2 in the 4 bytes
          before the row, group g's e4m3 scale 4 + g + 1 bytes before it (16 columns a group);
          w = (e2m1 * e4m3) * s2                             (K % 16 == 0)

`dense` decodes either into float32 exactly as the loader's reference does (one rounding a
weight: `formats.int_grouped`), so the kernel's outputs are the float kernel's on `dense(w)`,
bit for bit. Everything that is not the kernel (prefill matmuls, the reference path, CUDA)
reads `dense` of the rows it needs (`linear.FastLinear`, `moe._as`).
"""

from __future__ import annotations

import ctypes

import torch

from baton.model.quant.served import QUANTIZE_GROUP

GROUP = QUANTIZE_GROUP
I8_PREFIX = 16
"""Bytes before an int8 row's first weight (its scale in the last 4): rows 16-byte aligned."""
KINDS = {torch.int8: "int8", torch.uint8: "int4", torch.float8_e4m3fn: "fp8",
         torch.float4_e2m1fn_x2: "nvfp4"}
NVFP4_GROUP = 16
FP8_GROUP = 128


I8G_TAG = 0xFF
"""The top byte of a row's 4 bytes before its first weight in the int8g layout (an int8 row's
float32 scale there is finite and below 2^127: never this byte)."""


def kind(t: torch.Tensor) -> str | None:
    """'int8' / 'int8g' / 'int4' / 'fp8' / 'nvfp4' for a packed weight, None for anything
    else (a float weight)."""
    k = KINDS.get(t.dtype) if t.dim() >= 2 else None
    if k == "int8" and _tagged(t):
        return "int8g"
    return k


def is_packed(t: torch.Tensor) -> bool:
    """`kind(t) is not None`, without reading the int8 tag (a forward's check)."""
    return t.dtype in KINDS and t.dim() >= 2


def _tagged(t: torch.Tensor) -> bool:
    if t.device.type != "cpu" or t.numel() == 0 or t.storage_offset() < 4:
        return False
    return ctypes.c_uint8.from_address(t.data_ptr() - 1).value == I8G_TAG  # in the storage


def _round128(n: int) -> int:
    return -(-n // I8G_CHUNK) * I8G_CHUNK


I8G_CHUNK = 128
"""Columns of an int8g weight laid out in the integer path's lane order at a time."""


def _i8g_order(u: torch.Tensor) -> torch.Tensor:
    """Bytes [..., Kp] (Kp % 128 == 0) in column order -> int8g's stored order."""
    return u.unflatten(-1, (-1, 16, 2, 4)).transpose(-3, -2).flatten(-4)


def _i8g_columns(b: torch.Tensor) -> torch.Tensor:
    """int8g's stored bytes [..., Kp] -> column order."""
    return b.unflatten(-1, (-1, 2, 16, 4)).transpose(-3, -2).flatten(-4)


def _i8g_prefix(k: int) -> int:
    """Bytes before an int8g row: the tag, its float16 scales and the integer-path mark."""
    return _round16(4 + 2 * -(-k // GROUP) + 1)


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def _i4_prefix(k: int) -> int:
    """Bytes before an int4 row: its float16 scales, and at least one byte (the first: the
    integer-path mark, `mark_int_path`)."""
    return _round16(2 * (k // GROUP) + 1)


CHUNK_BYTES = 1 << 20
"""Float32 bytes of a weight quantized at a time (`pack`): the temporaries stay small, so
loading never holds more than the tensor being read beside the packed model."""


def pack(w: torch.Tensor, mode: str) -> torch.Tensor:
    """`w` [..., N, K] (float) quantized as `model.quantize` does (`quantize.encode`, row by
    row: the same values) and laid out packed, a few rows at a time."""
    from baton.model.quant.quantize import encode

    *lead, n, k = w.shape
    if mode not in ("int8", "int8g", "int4"):
        raise ValueError(f"packed mode {mode!r}: int8, int8g or int4")
    if mode == "int4" and k % GROUP:
        raise ValueError(f"int4 weight of width {k}: a multiple of {GROUP} is packed")
    flat = w.reshape(-1, k)
    out, grid, _ = _layout(w.shape, mode)
    step = max(1, CHUNK_BYTES // (4 * max(k, 1)))
    for r in range(0, flat.shape[0], step):
        parts = encode(flat[r:r + step], mode)
        if mode == "int8":
            _fill_int8(grid[r:r + step], parts["weight"], parts["weight_scale"])
        elif mode == "int8g":
            _fill_int8g(grid[r:r + step], parts["weight"], parts["weight_scale"])
        else:
            from baton.model.quant.formats import unpack_int32

            _fill_int4(grid[r:r + step], unpack_int32(parts["weight_packed"], 4, k),
                       parts["weight_scale"])
    return out


def _layout(shape, mode: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the packed view, its rows' bytes [rows, ldw], the row prefix) of a new zeroed weight."""
    *lead, n, k = shape
    rows = n
    for d in lead:
        rows *= d
    if mode == "int8":
        prefix = I8_PREFIX
        ldw = prefix + _round16(k)
        buf = torch.zeros(rows * ldw, dtype=torch.uint8)
        view = buf.view(torch.int8).as_strided(shape, _strides(lead, n, ldw), prefix)
    elif mode == "int8g":
        prefix = _i8g_prefix(k)
        ldw = prefix + _round128(k)
        buf = torch.zeros(rows * ldw, dtype=torch.uint8)
        buf.view(rows, ldw)[:, prefix - 4:prefix] = I8G_TAG
        view = buf.view(torch.int8).as_strided(shape, _strides(lead, n, ldw), prefix)
    else:
        prefix = _i4_prefix(k)
        ldw = prefix + _round16(k // 2)
        buf = torch.zeros(rows * ldw + k, dtype=torch.uint8)  # + k: the view's last row fits
        view = buf.as_strided(shape, _strides(lead, n, ldw), prefix)
    return view, buf[:rows * ldw].view(rows, ldw), prefix


def pack_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 values q [..., N, K] and float32 scales [..., N, ceil(K / 128)] (each row's
    scale for columns [128 g, 128 g + 128))."""
    *lead, n, k = q.shape
    rows, groups = q.numel() // max(k, 1), -(-k // FP8_GROUP)
    prefix = _round16(4 * groups)
    ldw = prefix + _round16(k)
    buf = torch.zeros(rows * ldw, dtype=torch.uint8)
    grid = buf.view(rows, ldw)
    grid[:, prefix:prefix + k] = q.reshape(rows, k).view(torch.uint8)
    s = scale.to(torch.float32).reshape(rows, groups).flip(-1).contiguous()
    grid[:, prefix - 4 * groups:prefix] = s.view(torch.uint8)
    return buf.view(torch.float8_e4m3fn).as_strided(q.shape, _strides(lead, n, ldw), prefix)


def pack_nvfp4(q: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """NVFP4 as ModelOpt stores it: bytes q [..., N, K / 2] (uint8), e4m3 scales
    [..., N, K / 16], the float32 tensor scale (or one a row: [..., N])."""
    *lead, n, half = q.shape
    k, groups = 2 * half, half // (NVFP4_GROUP // 2)
    rows = q.numel() // max(half, 1)
    prefix = _round16(4 + groups)
    ldw = prefix + _round16(half)
    buf = torch.zeros(rows * ldw + k, dtype=torch.uint8)
    grid = buf[:rows * ldw].view(rows, ldw)
    grid[:, prefix:prefix + half] = q.reshape(rows, half).view(torch.uint8)
    s = scale.reshape(rows, groups).view(torch.uint8).flip(-1)
    grid[:, prefix - 4 - groups:prefix - 4] = s
    s2 = scale_2.to(torch.float32).reshape(-1, 1)  # one for the tensor, or one a row
    s2 = s2.expand(rows, 1).contiguous() if s2.shape[0] == 1 else s2
    grid[:, prefix - 4:prefix] = s2.view(torch.uint8)
    return buf.view(torch.float4_e2m1fn_x2).as_strided((*lead, n, k), _strides(lead, n, ldw),
                                                       prefix)


def _prefix(t: torch.Tensor) -> int:
    k = t.shape[-1]
    return {"int8": I8_PREFIX, "int8g": _i8g_prefix(k), "int4": _i4_prefix(k),
            "fp8": _round16(4 * -(-k // FP8_GROUP)),
            "nvfp4": _round16(4 + k // NVFP4_GROUP)}[kind(t)]


def stack(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Packed 2-D weights of one kind and width, their rows one after another, as one packed
    [E, N, K] stack of `shape` (MoE experts stored one tensor per expert)."""
    first = parts[0]
    k, prefix, ldw = first.shape[-1], _prefix(first), first.stride(-2)
    rows = sum(t.shape[0] for t in parts)
    if (any(kind(t) != kind(first) or t.shape[-1] != k or t.stride(-2) != ldw for t in parts)
            or rows * k != torch.Size(shape).numel()):
        raise ValueError(f"packed stack {list(shape)}: parts of other kinds or widths")
    buf = torch.zeros(rows * ldw + (k if kind(first) in ("int4", "nvfp4") else 0),
                      dtype=torch.uint8)
    grid = buf[:rows * ldw].view(rows, ldw)
    at = 0
    for t in parts:
        n = t.shape[0]
        grid[at:at + n] = _bytes(t, ldw, prefix)
        at += n
    return buf.view(first.dtype).as_strided(shape, _strides(list(shape[:-2]), shape[-2], ldw),
                                            prefix)


def _fill_int8(grid: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    rows, k = q.shape[0], q.shape[-1]
    grid[:, I8_PREFIX:I8_PREFIX + k] = q.reshape(rows, k).view(torch.uint8)
    s = scale.to(torch.float32).reshape(rows, 1).contiguous()
    if not bool(torch.isfinite(s).all()) or bool((s.abs() >= 2.0 ** 127).any()):
        raise ValueError("packed int8: a row scale that is not finite or not below 2^127")
    grid[:, I8_PREFIX - 4:I8_PREFIX] = s.view(torch.uint8)


def _fill_int8g(grid: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    k = q.shape[-1]
    rows, groups = q.numel() // max(k, 1), -(-k // GROUP)
    prefix, kp = _i8g_prefix(k), _round128(k)
    u = torch.full((rows, kp), 0x80, dtype=torch.uint8)
    u[:, :k] = q.reshape(rows, k).view(torch.uint8) ^ 0x80
    grid[:, prefix:prefix + kp] = _i8g_order(u)
    s = scale.to(torch.float16).reshape(rows, groups).flip(-1).contiguous()
    grid[:, prefix - 4 - 2 * groups:prefix - 4] = s.view(torch.uint8)


def _fill_int4(grid: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    k = q.shape[-1]
    rows, groups = q.numel() // max(k, 1), k // GROUP
    prefix = _i4_prefix(k)
    u = (q.reshape(rows, k).to(torch.int16) + 8).to(torch.uint8)
    grid[:, prefix:prefix + k // 2] = u[:, 0::2] | (u[:, 1::2] << 4)
    s = scale.to(torch.float16).reshape(rows, groups).flip(-1).contiguous()
    grid[:, prefix - 2 * groups:prefix] = s.view(torch.uint8)


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 values q [..., N, K] and one float32 scale a row ([..., N] or [..., N, 1])."""
    view, grid, _ = _layout(q.shape, "int8")
    _fill_int8(grid, q.reshape(-1, q.shape[-1]), scale)
    return view


def pack_int8g(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 values q [..., N, K] and float16 scales [..., N, ceil(K / 32)] (group g's for
    columns [32 g, 32 g + 32))."""
    view, grid, _ = _layout(q.shape, "int8g")
    _fill_int8g(grid, q.reshape(-1, q.shape[-1]), scale)
    return view


def pack_int4(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Signed int4 values q [..., N, K] in [-8, 7] (K a multiple of 32) and float16 scales
    [..., N, K / 32]."""
    k = q.shape[-1]
    if k % GROUP:
        raise ValueError(f"int4 weight of width {k}: a multiple of {GROUP} is packed")
    view, grid, _ = _layout(q.shape, "int4")
    _fill_int4(grid, q.reshape(-1, k), scale)
    return view


def _strides(lead: list[int], n: int, ldw: int) -> tuple[int, ...]:
    strides, step = [ldw, 1], n * ldw
    for d in reversed(lead):
        strides.insert(0, step)
        step *= d
    return tuple(strides)


def _bytes(t: torch.Tensor, width: int, before: int) -> torch.Tensor:
    """Each row's `width` bytes starting `before` bytes before its first weight [..., N, w]."""
    base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return base.as_strided((*t.shape[:-1], width), (*t.stride()[:-1], 1),
                           t.storage_offset() - before)


def scales(t: torch.Tensor) -> torch.Tensor:
    """A packed weight's scales: int8 [..., N] float32, int8g [..., N, ceil(K / 32)] float16,
    int4 [..., N, K / 32] float16, fp8 [..., N, ceil(K / 128)] float32."""
    if kind(t) == "int8":
        return _bytes(t, 4, 4).contiguous().view(torch.float32)[..., 0]
    if kind(t) == "int8g":
        groups = -(-t.shape[-1] // GROUP)
        return _bytes(t, 2 * groups, 4 + 2 * groups).contiguous().view(torch.float16).flip(-1)
    if kind(t) == "fp8":
        groups = -(-t.shape[-1] // FP8_GROUP)
        return _bytes(t, 4 * groups, 4 * groups).contiguous().view(torch.float32).flip(-1)
    groups = t.shape[-1] // GROUP
    return _bytes(t, 2 * groups, 2 * groups).contiguous().view(torch.float16).flip(-1)


def values(t: torch.Tensor) -> torch.Tensor:
    """A packed int8 / int8g / int4 weight's integer values [..., N, K] (int16)."""
    if kind(t) == "int8":
        return t.to(torch.int16)
    if kind(t) == "int8g":
        b = _i8g_columns(_bytes(t, _round128(t.shape[-1]), 0))[..., :t.shape[-1]]
        return b.to(torch.int16) - 128
    b = _bytes(t, t.shape[-1] // 2, 0).to(torch.int16)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2) - 8


def dense(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A packed weight decoded (float32: each weight float(q) * scale, one rounding; the
    loader's reference), then cast to `dtype`; a float tensor as it is."""
    from baton.model.quant.formats import int_grouped

    k = kind(t)
    if k is None:
        return t
    if k == "nvfp4":
        from baton.model.quant.formats import E2M1_PAIRS

        groups = t.shape[-1] // NVFP4_GROUP
        s = _bytes(t, groups, 4 + groups).flip(-1).contiguous().view(torch.float8_e4m3fn)
        s2 = _bytes(t, 4, 4).contiguous().view(torch.float32)  # [..., N, 1]: a row's (an
        b = _bytes(t, t.shape[-1] // 2, 0).to(torch.int64)   # expert's) tensor scale
        vals = E2M1_PAIRS[b].flatten(-2).unflatten(-1, (-1, NVFP4_GROUP))
        w = (vals * s.to(torch.float32)[..., None]).flatten(-2) * s2  # formats.nvfp4's order
        return w if dtype == torch.float32 else w.to(dtype)
    if k == "fp8":
        s = scales(t).repeat_interleave(FP8_GROUP, dim=-1)[..., :t.shape[-1]]
        w = t.to(torch.float32) * s
        return w if dtype == torch.float32 else w.to(dtype)
    w = int_grouped(values(t), scales(t), None, None if k == "int8" else GROUP)  # int8g, int4
    return w if dtype == torch.float32 else w.to(dtype)


def nbytes(t: torch.Tensor) -> int:
    """Bytes a packed weight's storage holds."""
    return t.untyped_storage().nbytes()


UNITS = {"int8": 1, "int8g": GROUP, "int4": GROUP, "fp8": FP8_GROUP, "nvfp4": NVFP4_GROUP}
"""Columns of a packed kind's scale group: a column cut must fall on a multiple of it (or
end the row)."""


def _parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A packed weight as (values [..., N, K'], its scales [..., N, G], ...): K' = K (int8
    int8, int4 int16 in [-8, 7], fp8 float8) or K / 2 (nvfp4 bytes, then the float32 tensor
    scale of each row [..., N])."""
    k = kind(t)
    if k == "int8":
        return t.contiguous(), scales(t)
    if k == "int8g":
        return values(t).to(torch.int8), scales(t)
    if k == "int4":
        return values(t), scales(t)
    if k == "fp8":
        return t.contiguous(), scales(t)
    groups = t.shape[-1] // NVFP4_GROUP
    s = _bytes(t, groups, 4 + groups).flip(-1).contiguous().view(torch.float8_e4m3fn)
    return (_bytes(t, t.shape[-1] // 2, 0).contiguous(), s,
            _bytes(t, 4, 4).contiguous().view(torch.float32)[..., 0])


def _repack(k: str, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if k == "int8":
        return pack_int8(parts[0], parts[1])
    if k == "int8g":
        return pack_int8g(parts[0], parts[1])
    if k == "int4":
        return pack_int4(parts[0], parts[1])
    if k == "fp8":
        return pack_fp8(parts[0], parts[1])
    return pack_nvfp4(parts[0], parts[1], parts[2])


def cut(t: torch.Tensor, index: tuple[slice, ...]) -> torch.Tensor:
    """The part `t[index]` of a packed weight (one slice a dim, steps of 1), packed anew with
    its scales: `dense(cut(t, i))` equals `dense(t)[i]` bit for bit. The columns must start on
    a scale group (`UNITS`) and end on one or at the row's end (ValueError otherwise: callers
    name the tensor first)."""
    k = kind(t)
    n_cols = t.shape[-1]
    *lead, cols = index + (slice(None),) * (t.dim() - len(index))
    c, d, _ = cols.indices(n_cols)
    unit = UNITS[k]
    if c % unit or (d % unit and d != n_cols) or d <= c:
        raise ValueError(f"packed {k} columns [{c}:{d}] of {n_cols}: groups of {unit}")
    g = slice(c // unit, -(-d // unit))
    parts = _parts(t)
    vals = parts[0][(*lead, slice(c // 2, d // 2) if k == "nvfp4" else slice(c, d))]
    scale = parts[1][tuple(lead) if k == "int8" else (*lead, g)]
    rest = tuple(p[tuple(lead)] for p in parts[2:])
    return _repack(k, (vals, scale, *rest))


def cat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Packed weights of one kind and width joined along `dim` (a dim before the last: rows,
    or experts of a stack), packed anew."""
    if len(parts) == 1:
        return parts[0]
    k = kind(parts[0])
    dim = dim % parts[0].dim()
    if dim == parts[0].dim() - 1 or any(kind(p) != k for p in parts):
        raise ValueError(f"packed {k} weights are joined along a dim before the last")
    split = [_parts(p) for p in parts]
    return _repack(k, tuple(torch.cat(xs, dim=dim) for xs in zip(*split, strict=True)))


ACT_GROUP = 32
"""Columns of x that share one int8 scale on the integer path (llama.cpp's Q8_0 block)."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] as the integer path quantizes them (`cpu_kernels/gemv_int.h`): per
    group of 32 columns, K padded with zeros to a multiple of 64, d = amax / 127 and
    q = round-half-even(x / d) (as x * (1 / d)) in [-127, 127]. Returns (q [M, Kp] int8,
    d [M, Kp / 32] float32)."""
    m, k = x.shape
    kp = -(-k // 64) * 64
    xp = torch.zeros(m, kp, dtype=torch.float32)
    xp[:, :k] = x
    xg = xp.view(m, kp // ACT_GROUP, ACT_GROUP)
    d = xg.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xg * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(m, kp), d


def int_linear_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """x [M, K] float32 through a packed int8 / int8g / int4 weight [N, K] on the integer path,
    in torch (the kernels' contract, `cpu_kernels/gemv_int.h`): 16 lanes, each an integer sum
    p per chunk (int8: chunks of 64 columns, lane 8 (g % 2) + j the 4 columns j of group g;
    int8g / int4: chunks of 128, lane L the 8 columns from 8 L); c_g = d_g (int8) or
    d_g * s_g (int8g, int4: the weight's group scale, one rounding); acc[L] = fma(p, c_g,
    acc[L]) over the chunks; a fixed tree of the lanes; times the row scale (int8); + bias."""
    m, k = x.shape
    n = w.shape[0]
    wk = kind(w)
    q, d = quantize_rows(x.float())
    chunk = 64 if wk == "int8" else 128
    kp = -(-k // chunk) * chunk
    groups = kp // ACT_GROUP
    qx = torch.zeros(m, kp, dtype=torch.int64)
    qx[:, :min(kp, q.shape[1])] = q[:, :kp].to(torch.int64)
    dx = torch.zeros(m, groups, dtype=torch.float32)
    dx[:, :min(groups, d.shape[1])] = d[:, :groups]
    qw = torch.zeros(n, kp, dtype=torch.int64)
    qw[:, :k] = values(w).to(torch.int64)
    chunks = kp // chunk
    per = chunk // 16  # columns a lane sums
    p = (qx.view(m, 1, chunks, 16, per) * qw.view(1, n, chunks, 16, per)).sum(-1)
    if wk == "int8":
        c = dx[:, None, :].expand(m, n, groups)
    else:
        s = torch.zeros(n, groups, dtype=torch.float32)
        sw = scales(w).float()
        s[:, :sw.shape[1]] = sw
        c = dx[:, None, :] * s[None]
    # each lane's group: int8 lanes 0-7 / 8-15 the chunk's two groups, int8g / int4 4 a group
    lane_group = torch.arange(16) // (8 if wk == "int8" else 4)
    acc = torch.zeros(m, n, 16, dtype=torch.float32)
    for ch in range(chunks):
        cg = c[..., ch * (chunk // ACT_GROUP) + lane_group]  # [M, N, 16]
        fused = p[..., ch, :].double() * cg.double() + acc.double()
        acc = fused.float()  # one rounding (the product is exact in float64)
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    y = s2[..., 0] + s2[..., 1]
    if wk == "int8":
        y = y * scales(w).float()[None]
    if bias is not None:
        y = y + bias.float()
    return y


INT_KINDS = ("int8", "int8g", "int4")
"""Packed kinds the integer path computes with."""


def _mark_bytes(t: torch.Tensor) -> torch.Tensor:
    return _bytes(t, 1, _prefix(t))


def mark_int_path(t: torch.Tensor, on: bool = True) -> None:
    """Mark a packed int8 / int8g / int4 weight (every row's first prefix byte) so that the
    kernels take their integer path on it (`cpu_kernels/gemv_int.h`); per weight, so two
    models in one process keep their own numerics."""
    if kind(t) not in INT_KINDS:
        raise ValueError(f"integer path: a packed int8 / int4 weight is marked, not {t.dtype}")
    _mark_bytes(t).fill_(1 if on else 0)


def int_path(t: torch.Tensor) -> bool:
    """Whether a packed weight is marked for the integer path (its first row's mark)."""
    if kind(t) not in INT_KINDS or t.numel() == 0:
        return False
    return bool(_mark_bytes(t).reshape(-1)[0].item())


class PackedEmbedding(torch.nn.Module):
    """An embedding table kept packed int8g (a float16 scale per 32 columns,
    `model.quantize_embeddings`; or int8, one float32 scale a row): a lookup decodes only the
    rows it reads, each value float(q) * scale as `dense` does."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if kind(weight) not in ("int8", "int8g") or weight.dim() != 2:
            raise ValueError(f"packed embedding: a packed int8 [V, H] table, not {weight.dtype}")
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.num_embeddings, self.embedding_dim = weight.shape
        self._grouped = kind(weight) == "int8g"
        self._raw: tuple[int, torch.Tensor] | None = None

    def _rows(self) -> torch.Tensor:
        """int8g: each row's scales, tag and values as bytes (a view of the weight's storage,
        made again where the weight moved: `hugepages.on_huge_pages`)."""
        w = self.weight
        if self._raw is None or self._raw[0] != w.data_ptr():
            groups = -(-w.shape[-1] // GROUP)
            self._raw = (w.data_ptr(), _bytes(w, 4 + 2 * groups + _round128(w.shape[-1]),
                                              4 + 2 * groups))
        return self._raw[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self._grouped:
            k = self.embedding_dim
            groups = -(-k // GROUP)
            raw = self._rows()[flat]
            s = raw[:, :2 * groups].view(torch.float16).flip(-1).to(torch.float32)
            q = _i8g_columns(raw[:, 4 + 2 * groups:])[:, :k].to(torch.float32) - 128
            if k % GROUP == 0:  # as formats.int_grouped: one product a value
                rows = (q.view(-1, groups, GROUP) * s[..., None]).view(-1, k)
            else:
                rows = q * s.repeat_interleave(GROUP, dim=-1)[:, :k]
        else:
            rows = self.weight[flat].to(torch.float32) * _bytes(self.weight, 4, 4)[flat].contiguous(
            ).view(torch.float32)
        return rows.view(*ids.shape, self.embedding_dim)
