"""Gated delta rule math for one DeltaNet layer: the chunked scan (prefill) and the one-token
recurrent step (decode), both in float32.

Shapes (a batch of n sequences of T tokens each):
    q, k  [n, T, HK, dk]   (L2-normalised here; q also scaled by dk^-1/2)
    v     [n, T, HV, dv]   g (log decay, <= 0), beta  [n, T, HV]
    state [n, HV, dk, dv]  o [n, T, HV, dv]
Key head j serves value heads j*r .. j*r+r-1 (r = HV / HK).

The recurrence both functions implement, per value head:
    S_t = exp(g_t) S_{t-1};  u_t = beta_t (v_t - S_t^T k_t);  S_t += k_t u_t^T;  o_t = S_t^T q_t
The scan computes it chunk by chunk (chunk 64, transformers' `torch_chunk_gated_delta_rule`),
with chunks counted from the call's first token, so prefilling a prompt in several calls
from the saved state computes the same recurrence as one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _heads_first(q, k, v, g, beta):
    """float32, [n, HV, T, ...], q/k repeated per value head, normalised, q scaled."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_scan(q, k, v, g, beta, state: torch.Tensor | None, chunk: int = 64):
    """Run T tokens of n sequences from `state` (zeros if None): (o [n,T,HV,dv] float32,
    final state [n,HV,dk,dv] float32)."""
    n, T, _, dk = k.shape
    HV, dv = v.shape[2], v.shape[3]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(n, HV, -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(n, HV, -1, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    # UT transform: solve the unit-lower-triangular (beta k k^T o decay) system once per chunk.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    S = q.new_zeros(n, HV, dk, dv) if state is None else state.float()
    out = torch.empty_like(values)
    for i in range(values.shape[2]):
        v_new = values[:, :, i] - k_cum[:, :, i] @ S
        out[:, :, i] = q[:, :, i] @ S + intra[:, :, i] @ v_new
        S = S * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(n, HV, -1, dv)[:, :, :T].transpose(1, 2)
    return out, S


def recurrent_step_(state: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
    """One token for each of b sequences, updating the float32 `state` [b,HV,dk,dv] in place
    (a view of the pool, say). q/k [b,HK,dk], v [b,HV,dv], g/beta [b,HV]; returns o [b,HV,dv]."""
    q, k, v, g, beta = (x[:, None] for x in (q, k, v, g, beta))
    q, k, v, g, beta = (x[:, :, 0] for x in _heads_first(q, k, v, g, beta))
    state.mul_(g.exp()[..., None, None])
    mem = (k[:, :, None, :] @ state)[:, :, 0]  # S^T k: [b, HV, dv]
    delta = (v - mem) * beta[..., None]
    state.add_(k[..., :, None] * delta[..., None, :])
    return (q[:, :, None, :] @ state)[:, :, 0]
