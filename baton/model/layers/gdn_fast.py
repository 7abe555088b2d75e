"""The fast path's gated DeltaNet prefill scan (`chunk_scan_fast`): the chunked recurrence of
`baton.model.layers.gdn.chunk_scan`, the same closed form, with less work around its matmuls:
- q k^T and k k^T once per key head (the value heads of a key head share them, only the decay
  and beta differ), and no repeat of q and k per value head;
- the decay matrices in one kernel pass each (`step_kernels` ssd_decay: the masked
  exp(cum_i - cum_j) times the shared product, the difference in float64, no cancellation);
- one triangular solve for values and keys together (one right-hand side of dv + dk), by a
  forward-substitution kernel (LAPACK's batched trsm runs far below the matmul rate);
- the per-chunk loop only carries the state (v_new, then S), two batched matmul-adds a chunk;
  every chunk's output is then one batched matmul, [intra | q decay] @ [v_new ; S], the first
  factor never in memory where dv is a multiple of 16 (`step_kernels` decay_matmul, as in
  `ssd_fast`);
- no padding copies when T is a multiple of the chunk; decays below e^FLUSH are 0 (their
  products would be float32 denormals, which slow every op that meets them), and as the solve
  still makes some, the scan runs with denormals flushed to zero (`ssd_fast.denormals_flushed`).
It rounds differently from the reference (about 1e-6), so it runs only on the fast path, and
needs the step kernels (`fused.fast_prefill`). Measured figures: docs/performance.md.
"""

from __future__ import annotations

import torch

from baton.model.layers import step_kernels
from baton.model.layers.ssd_fast import _exp, denormals_flushed


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _chunked(t: torch.Tensor, c: int, L: int) -> torch.Tensor:
    """[n, T, heads, ...] -> [n, heads, c, L, ...] contiguous, zero past T."""
    n, T = t.shape[:2]
    out = t.new_empty(n, t.shape[2], c * L, *t.shape[3:])
    out[:, :, T:] = 0
    out[:, :, :T] = t.transpose(1, 2)
    return out.view(n, t.shape[2], c, L, *t.shape[3:])


def chunk_scan_fast(q, k, v, g, beta, state: torch.Tensor | None, chunk: int = 64):
    """`gdn.chunk_scan` on the fast path: q, k [n, T, HK, dk], v [n, T, HV, dv], g, beta
    [n, T, HV], state [n, HV, dk, dv] or None. Returns (o [n, T, HV, dv] float32, contiguous;
    final state [n, HV, dk, dv] float32)."""
    with denormals_flushed():
        return _scan(q, k, v, g, beta, state, chunk)


def _scan(q, k, v, g, beta, state, chunk):
    n, T, HK, dk = k.shape
    HV, dv = v.shape[2:]
    r, L = HV // HK, chunk
    c = -(-T // L)
    q = _l2norm(q.float()) * dk**-0.5
    qh, kh = _chunked(q, c, L), _chunked(_l2norm(k.float()), c, L)  # [n, HK, c, L, dk]
    vh = _chunked(v.float(), c, L)  # [n, HV, c, L, dv]
    bh = _chunked(beta.float()[..., None], c, L)  # [n, HV, c, L, 1]
    cum64 = _chunked(g.double()[..., None], c, L)[..., 0].cumsum(-1)  # [n, HV, c, L]
    kern = step_kernels.kernels()
    # UT transform: the unit-lower-triangular system beta_i (k_i . k_j) decay(j -> i).
    system = kern.ssd_decay(kh @ kh.transpose(-1, -2), cum64, r, None).mul_(bh)
    ecum = _exp(cum64)[..., None]  # decay from the chunk's start, [n, HV, c, L, 1]
    kr = kh.view(n, HK, 1, c, L, dk)
    rhs = torch.cat([vh * bh, (kr * (bh * ecum).view(n, HK, r, c, L, 1)).view(n, HV, c, L, dk)],
                    dim=-1)
    W = dv + dk
    sol = kern.unit_lower_solve(system.view(-1, L, L), rhs.view(-1, L, W)).view(n, HV, c, L, W)
    values, k_cum = sol[..., :dv], sol[..., dv:]
    # Each chunk's output, [intra | q decay(start -> t)] @ [v_new ; S entering], is one
    # matmul: the kernel writes the first factor, the loop below the second (X).
    to_end = _exp(cum64[..., -1:] - cum64).view(n, HK, r, c, L, 1)
    k_end = (kr * to_end).view(n * HV, c, L, dk).transpose(-1, -2)  # [nHV, c, dk, L]
    chunk_decay = _exp(cum64[..., -1]).view(n * HV, c, 1, 1)
    S = (q.new_zeros(n * HV, dk, dv) if state is None
         else state.float().reshape(n * HV, dk, dv))
    values, k_cum = values.reshape(n * HV, c, L, dv), k_cum.reshape(n * HV, c, L, dk)
    X = q.new_empty(n * HV, c, L + dk, dv)
    for i in range(c):
        X[:, i, L:] = S
        v_new = torch.baddbmm(values[:, i], k_cum[:, i], S, alpha=-1)
        X[:, i, :L] = v_new
        S = torch.baddbmm(S * chunk_decay[:, i], k_end[:, i], v_new)
    if dv % 16 == 0:  # the decay matrix never in memory (`decay_matmul`)
        o = kern.decay_matmul(qh @ kh.transpose(-1, -2), cum64, r, qh,
                              X.view(n, HV, c, L + dk, dv))
    else:
        lhs = kern.ssd_decay(qh @ kh.transpose(-1, -2), cum64, r, qh)  # [n, HV, c, L, L + dk]
        o = lhs.view(n * HV, c, L, L + dk) @ X
    o = o.view(n, HV, c * L, dv)[:, :, :T].transpose(1, 2).contiguous()
    return o, S.view(n, HV, dk, dv)
