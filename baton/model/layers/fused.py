"""Fused decode steps of the recurrent mixers (the fast decode path, `BATON_DECODE_PATH=fast`).

What a Mamba2 or DeltaNet layer does per decode step between its input and output projections
(conv window, gates, state update, read-out, gated norm) is a dozen small element-wise ops
and a few passes over the state; in eager PyTorch each is a kernel call and a full pass over
its operands. Here each mixer's step is one function compiled by inductor (C++ on CPU), which
fuses it into a few loops that read and write the state once, straight in the pool's slots.

Measured on the 2-core dev machine (one thread, bench 100m NemotronH, per Mamba2 layer, the
state read-out and update alone): batch 1 209 -> 44 us, batch 8 395 -> 182 us, batch 32
2040 -> 633 us. The fused steps round differently from the eager reference (sums in another
order, FMA): about 1e-6 relative, like the packed linears; the fast path is compared with the
reference in tests/unit/test_decode_fast_path.py.

Only the fast path calls these, and only on CPU float32; a compiler failure (no C++ toolchain)
falls back once, with a warning, to running the same function eagerly.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from baton.model.layers import linear

_broken: set[str] = set()


def fast_decoding(x: torch.Tensor) -> bool:
    """True inside a marked decode call on the fast path, for float32 CPU activations."""
    return (linear.decode_path() == "fast" and linear.decoding()
            and x.dtype == torch.float32 and x.device.type == "cpu")


@functools.cache
def _compiled(name: str, threads: int, dims: tuple):
    """The compiled step `name` for one layer geometry and thread count (inductor bakes the
    thread count into its kernels, so a process that changes it gets kernels for each)."""
    fn = functools.partial(_STEPS[name], *dims)
    return torch.compile(fn, fullgraph=True)


def run(name: str, dims: tuple, *args):
    """Step `name` (compiled; eager if compiling fails) on `args`."""
    if name not in _broken:
        try:
            fn = _compiled(name, torch.get_num_threads(), dims)
            for t in args[:_BATCHED[name]]:  # only the batch size varies between calls
                torch._dynamo.maybe_mark_dynamic(t, 0)
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


_STEPS = {"mamba2": mamba2_step, "deltanet": deltanet_step}
_BATCHED = {"mamba2": 3, "deltanet": 6}
"""How many leading arguments of each step have the batch as their first dimension."""
