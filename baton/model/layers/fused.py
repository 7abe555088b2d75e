"""Fused decode steps of the recurrent mixers and of paged attention, compiled by inductor: the
fast decode path's fallback where Baton's C++ step kernels do not build.

What a Mamba2 or DeltaNet layer does per decode step between its input and output projections
(conv window, gates, state update, read-out, gated norm) is a dozen small element-wise ops and a
few passes over the state; in eager PyTorch each is a kernel call and a full pass over its
operands. Here each mixer's step is one function compiled by inductor (C++ on CPU), which fuses
it into a few loops that read and write the state once, straight in the pool's slots. Attention
(`attention_step`) reads each key and value straight from the paged pool inside the compiled
loop, so no dense [b, kv_heads, keys, hd] history is gathered first.

Shapes: only the batch (and, for attention, the key count) are dynamic; every other size is
baked in, which is what lets inductor vectorise the state loops. The fused steps round
differently from the eager reference (sums in another order, FMA): about 1e-6 relative, like the
packed linears; tests/unit/engine/test_decode_fast_path.py compares the fast path with the
reference. A speculating engine whose verify passes cannot run on the C++ step kernels
(`baton.engine.speculative.kernel_verify`) decodes on the reference path instead.

Only the fast path calls these, and only on CPU float32; a compiler failure (no C++ toolchain)
falls back once, with a warning, to running the same function eagerly. Where the C++ step
kernels build (`baton.model.layers.step_kernels`: the same steps, one pybind call each, on the
pools' slot rows in place), the layers call those instead: between two linears of a decode step
the caches are cold, and a compiled call's guards and wrappers then cost far more than a kernel
call. Measured figures: docs/performance.md.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.nn.functional as F

from baton.model import paged
from baton.model.layers import linear, step_kernels

_broken: set[str] = set()


def fast_decoding(x: torch.Tensor) -> bool:
    """True inside a marked decode call on the fast path, for float32 CPU activations."""
    return (linear.decode_path() == "fast" and linear.decoding()
            and x.dtype == torch.float32 and x.device.type == "cpu")


def fast_prefill(x: torch.Tensor) -> bool:
    """True outside a marked decode call on the fast path, for float32 CPU activations, where
    the step kernels (their prefill kernels) are built."""
    return (linear.decode_path() == "fast" and not linear.decoding()
            and x.dtype == torch.float32 and x.device.type == "cpu"
            and step_kernels.kernels() is not None)


@functools.cache
def _compiled(name: str, threads: int, dims: tuple):
    """The compiled step `name` for one layer geometry and thread count (inductor bakes the
    thread count into its kernels, so a process that changes it gets kernels for each).

    Each gets a copy of the step's code object: dynamo keeps its compiled graphs (and its
    recompile limit) per code object, so geometries and steps never evict each other."""
    base = _STEPS[name]
    code = base.__code__.replace(co_name=f"{base.__name__}_{_compiled.cache_info().currsize}")
    fn = types.FunctionType(code, base.__globals__, code.co_name, base.__defaults__,
                            base.__closure__)
    compiled = torch.compile(fn, fullgraph=True)
    return lambda *args: compiled(*dims, *args)


def run(name: str, dims: tuple, *args):
    """Step `name` (compiled; eager if compiling fails) on `args`."""
    if name not in _broken:
        try:
            fn = _compiled(name, torch.get_num_threads(), dims)
            for i, dims_of in _DYNAMIC[name]:  # only batch (and key count) vary between calls
                for d in dims_of:
                    torch._dynamo.maybe_mark_dynamic(args[i], d)
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: run it eagerly instead
            _broken.add(name)
            print(f"[baton] fused {name} step not compiled ({type(e).__name__}: {e}); "
                  "running it eagerly", file=sys.stderr, flush=True)
    return _STEPS[name](*dims, *args)


def mamba2_step(inter: int, heads: int, head_dim: int, groups: int, state_size: int,
                lo: float, hi: float, group_size: int, eps: float,
                zxbcdt, conv, ssm, conv_w, conv_b, dt_bias, A_log, D, norm_w):
    """One token of a Mamba2 layer after in_proj: zxbcdt [b, inter + conv_dim + H]; updates
    conv [b, conv_dim, K-1] and ssm [b, H, P, N] in place; returns the gated-normed y
    [b, inter] that out_proj reads (see `Mamba2Mixer.decode` for the reference ops)."""
    b = zxbcdt.shape[0]
    H, P, G, N = heads, head_dim, groups, state_size
    conv_dim = conv.shape[1]
    gate = zxbcdt[:, :inter]
    xbc = zxbcdt[:, inter:inter + conv_dim]
    dt = zxbcdt[:, inter + conv_dim:]
    window = torch.cat([conv, xbc[:, :, None]], dim=-1)
    out = (window * conv_w).sum(-1)
    if conv_b is not None:
        out = out + conv_b
    out = F.silu(out)
    conv.copy_(window[:, :, 1:])
    # Per head, not per (group, head in group): the update and the read-out then share one
    # loop nest, so inductor fuses them into a single pass over the state.
    r = H // G
    x = out[:, :H * P].reshape(b, H, P)
    Bm = out[:, H * P:H * P + G * N].reshape(b, G, N).repeat_interleave(r, dim=1)
    Cm = out[:, H * P + G * N:].reshape(b, G, N).repeat_interleave(r, dim=1)
    dt = F.softplus(dt + dt_bias).clamp(min=lo, max=hi)
    dA = torch.exp(dt * -torch.exp(A_log))
    new = ssm * dA[..., None, None] + (dt[..., None, None] * Bm[:, :, None, :]) * x[..., None]
    ssm.copy_(new)
    y = (new * Cm[:, :, None, :]).sum(-1) + D[:, None] * x
    g = (y.reshape(b, -1) * F.silu(gate)).reshape(b, -1, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return norm_w * g.reshape(b, -1)


def deltanet_step(hk: int, hv: int, dk: int, dv: int, eps: float,
                  qkv, conv, rec, a, beta_logit, z, conv_w, dt_bias, A_log, norm_w):
    """One token of a gated DeltaNet layer after its input projections: qkv [b, conv_dim],
    a / beta_logit [b, HV], z [b, HV*dv]; updates conv [b, conv_dim, K-1] and rec
    [b, HV, dk, dv] in place; returns the gated-normed output [b, HV*dv] that out_proj reads
    (see `GatedDeltaNet.decode` and `recurrent_step_` for the reference ops)."""
    b = qkv.shape[0]
    window = torch.cat([conv, qkv[:, :, None]], dim=-1)
    out = F.silu((window * conv_w).sum(-1))
    conv.copy_(window[:, :, 1:])
    r = hv // hk
    q = out[:, :hk * dk].reshape(b, hk, dk)
    k = out[:, hk * dk:2 * hk * dk].reshape(b, hk, dk)
    v = out[:, 2 * hk * dk:].reshape(b, hv, dv)
    q = (q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)  # [b, HV, dk]
    g = -torch.exp(A_log) * F.softplus(a + dt_bias)
    beta = torch.sigmoid(beta_logit)
    st = rec * torch.exp(g)[..., None, None]
    mem = (st * k[..., None]).sum(-2)  # S^T k: [b, HV, dv]
    delta = (v - mem) * beta[..., None]
    st = st + k[..., None] * delta[:, :, None, :]
    rec.copy_(st)
    o = (st * q[..., None]).sum(-2)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_w
    return (o * F.silu(z.reshape(b, hv, dv))).reshape(b, hv * dv)


def attention_step(scale: float, q, pool, key_rows, mask):
    """One query per sequence over paged KV, read straight from the pool (no gathered
    history): q [b, kv_heads, rep, hd]; pool [blocks, 2, tpb, kv_heads, hd] (one layer);
    key_rows [b, S] token row of each key's K in `pool.view(-1, kv_heads, hd)` (V is `tpb`
    rows on); mask [b, S] additive (0 / -inf). Returns [b, kv_heads, rep, hd]."""
    tpb, kvh, hd = pool.shape[2], pool.shape[3], pool.shape[4]
    rows = pool.view(-1, kvh, hd)
    keys, values = rows[key_rows], rows[key_rows + tpb]  # [b, S, kvh, hd], fused into loads
    scores = (q[:, None] * keys[:, :, :, None, :]).sum(-1) * scale + mask[:, :, None, None]
    probs = torch.softmax(scores, dim=1)  # [b, S, kvh, rep]
    return (probs[..., None] * values[:, :, :, None, :]).sum(1)


def kernel_attention(pools) -> bool:
    """True when this decode call's attention layers read KV through the step kernel (the
    fast path: float32 activations, a float32 / bfloat16 / fp8 pool on CPU, the kernels
    built): its metadata can be lean (`decode_meta`). A bfloat16 model (bfloat16 activations)
    reads through the gathered rows, so it needs the full metadata."""
    return (linear.decode_path() == "fast" and linear.decoding() and pools.has_kv
            and pools.spec.dtype == torch.float32
            and pools.kv.dtype in KV_FORMATS and pools.kv.device.type == "cpu"
            and step_kernels.kernels() is not None)


KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, paged.FP8: 2}
"""Pool dtype -> the step kernels' KV format (common.h KV_F32, KV_BF16, KV_FP8)."""


def paged_fast(pool: torch.Tensor) -> bool:
    """Whether a decode step's attention over `pool` (one layer's) may take `paged_attention`:
    a float32 pool, or a bfloat16 / fp8 one where the step kernels are built."""
    return pool.dtype == torch.float32 or (pool.dtype in KV_FORMATS
                                           and step_kernels.kernels() is not None)


def paged_attention(scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    pool: torch.Tensor, meta) -> torch.Tensor:
    """Store the decode tokens' k, v [b, kv_heads, hd] in one layer's pool, then
    `attention_step` for their queries q [b, heads, hd], `meta` the step's `AttnMeta`;
    returns [b, heads * hd]. A bfloat16 / fp8 pool: the kernel widens its rows a tile at a
    time (`paged_attention_q`); without its tables, the gathered history widened."""
    if pool.dtype != torch.float32:
        return _paged_attention_q(scale, q, k, v, pool, meta)
    kern = step_kernels.kernels()
    if kern is not None and meta.tables is not None:
        return kern.paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), pool,
                                    meta.tables, meta.lens, scale, meta.keys)
    b, heads, hd = q.shape
    kvh, S, tpb = pool.shape[3], meta.num_keys, pool.shape[2]
    tokens = pool.view(-1, kvh * hd)
    tokens.index_copy_(0, meta.write_rows, k.reshape(b, -1))
    tokens.index_copy_(0, meta.write_rows + tpb, v.reshape(b, -1))
    key_rows = meta.read_rows.view(2, b, kvh, S)[0, :, 0] // kvh
    out = run("attention", (scale,), q.view(b, kvh, heads // kvh, hd), pool, key_rows,
              meta.mask.view(b, S))
    return out.reshape(b, heads * hd)


def _paged_attention_q(scale, q, k, v, pool, meta):
    kern = step_kernels.kernels()
    b, heads, hd = q.shape
    if kern is not None and meta.tables is not None:  # the kernel stores k, v as it reads
        return kern.paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), pool,
                                    meta.tables, meta.lens, scale, meta.keys)
    kvh, S = pool.shape[3], meta.num_keys
    paged.store_kv(pool, meta.write_rows, k, v)
    kv = paged.dequantize(paged.gather_kv(pool, meta.read_rows), hd).view(2, b, kvh, S, hd)
    qg = q.view(b * kvh, heads // kvh, hd)
    scores = torch.bmm(qg, kv[0].reshape(-1, S, hd).transpose(1, 2)).mul_(scale)
    probs = torch.softmax(scores.view(b, heads, S) + meta.mask, dim=-1)
    out = torch.bmm(probs.view(-1, heads // kvh, S), kv[1].reshape(-1, S, hd))
    return out.reshape(b, heads * hd)


def prefill_attention_rows(scale: float, q: torch.Tensor, rows: torch.Tensor, pool: torch.Tensor,
                           meta) -> torch.Tensor:
    """`prefill_attention` over keys and values as `pool` stores them: rows [2, n, kv_heads, S,
    row] (`paged.gather_kv`). A bfloat16 / fp8 pool on the fast path: the kernel widens them
    as it lays them out (`prefill_attention_q`); elsewhere they are widened first."""
    hd = q.shape[-1]
    if pool.dtype == torch.float32:
        return prefill_attention(scale, q, rows[0], rows[1], meta)
    if fast_prefill(q) and meta.positions is not None:
        raw = rows.view(torch.uint8)
        return step_kernels.kernels().prefill_attention_q(q, raw[0], raw[1], meta.positions,
                                                          scale, KV_FORMATS[pool.dtype])
    kv = paged.dequantize(rows, hd)
    return prefill_attention(scale, q, kv[0], kv[1], meta)


def prefill_attention(scale: float, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      meta) -> torch.Tensor:
    """Causal attention of a prefill call: q [n, T, heads, hd] over keys, values [n, kv_heads,
    S, hd] (gathered from the pool), `meta` the call's `AttnMeta` (a query at position p reads
    keys 0..p). Returns [n, T, heads, hd].

    On the fast path (float32 on CPU, the step kernels built) the kernel computes every query
    row alone in a fixed order, so a token's output is the same bits whatever the call's length
    or the prompt's chunking (what makes prefix reuse exact); SDPA's is not (its key blocks and
    BLAS's sums follow the matrix sizes). Elsewhere SDPA."""
    if fast_prefill(q) and keys.dtype == torch.float32 and meta.positions is not None:
        return step_kernels.kernels().prefill_attention(q, keys, values, meta.positions, scale)
    heads, kv_heads = q.shape[2], keys.shape[1]
    mask = meta.mask
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
        attn_mask=None if mask is None else mask.to(q.dtype), is_causal=mask is None,
        scale=scale, enable_gqa=heads != kv_heads)
    return out.transpose(1, 2)


_STEPS = {"mamba2": mamba2_step, "deltanet": deltanet_step, "attention": attention_step}
_DYNAMIC = {"mamba2": ((0, (0,)), (1, (0,)), (2, (0,))),
            "deltanet": tuple((i, (0,)) for i in range(6)),
            "attention": ((0, (0,)), (2, (0, 1)), (3, (0, 1)))}
"""(argument, dimensions) of each step that vary between calls: the batch, the key count."""
