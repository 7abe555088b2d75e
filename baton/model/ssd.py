"""Mamba2 state-space math for one layer: the chunked SSD scan (prefill) and the one-token step.

Shapes (single sequence for the scan, batch B for the step):
    x  [T, H, P]   per-head inputs          dt [T, H]  softplus'd, clamped time step
    A  [H]         negative decay rates     B, C [T, G, N]  shared by the H/G heads of a group
    state [H, P, N]                         y  [T, H, P]

The recurrence both functions implement, per head h:
    state_t = exp(dt_t*A) * state_{t-1} + dt_t * x_t (outer) B_t
    y_t     = state_t @ C_t + D * x_t
The scan computes it chunk by chunk in closed form, so prefill has no per-token Python loop;
it is exact for any split of the sequence, which is what makes resumed prefill match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = a[..., j+1] + ... + a[..., i] for j <= i, -inf above the diagonal.

    Built from a masked cumsum rather than cumsum differences, which lose precision.
    """
    n = a.size(-1)
    a = a[..., None].expand(*a.shape, n)
    below = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=-1)
    out = torch.cumsum(a.masked_fill(~below, 0), dim=-2)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=0)
    return out.masked_fill(~causal, -torch.inf)


def _chunks(t: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """[T, ...] -> [T/chunk, chunk, ...], zero-padding the end (zero dt leaves the state alone)."""
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
    return t.reshape(-1, chunk, *t.shape[1:])


def ssd_scan(x, dt, A, B, C, D, chunk: int, state: torch.Tensor | None = None):
    """Run the recurrence over T tokens from `state` (zeros if None); return (y, final_state).

    Computed in float32 whatever the input dtype. Index letters: c chunk, l/s position in a
    chunk, h head, p head_dim, n state size.
    """
    T, H, P = x.shape
    rep = H // B.shape[1]
    x, dt = x.float(), dt.float()
    B = B.float().repeat_interleave(rep, dim=1)
    C = C.float().repeat_interleave(rep, dim=1)
    pad = (-T) % chunk
    skip = D.float()[:, None] * x
    xdt, Adt = x * dt[..., None], A.float() * dt
    xdt, Adt, B, C = (_chunks(t, pad, chunk) for t in (xdt, Adt, B, C))

    Adt = Adt.permute(2, 0, 1)  # [h, c, l]
    A_cum = torch.cumsum(Adt, dim=-1)
    # 1. within each chunk: attention-like quadratic form with a decay mask.
    L = torch.exp(segment_sum(Adt))
    G = torch.einsum("clhn,cshn->clsh", C, B)
    y_diag = torch.einsum("clsh,cshp->clhp", G * L.permute(1, 2, 3, 0), xdt)
    # 2. the state each chunk adds by its end.
    decay_to_end = torch.exp(A_cum[:, :, -1:] - A_cum)
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", B, decay_to_end, xdt)
    # 3. carry states across chunks: the state entering chunk i, and the final state.
    init = torch.zeros_like(chunk_states[:1]) if state is None else state.float()[None]
    chunk_states = torch.cat([init, chunk_states], dim=0)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cum[:, :, -1], (1, 0))))  # [h, i, j]
    states = torch.einsum("hij,jhpn->ihpn", decay_chunk, chunk_states)
    entering, final = states[:-1], states[-1]
    # 4. what the entering state contributes to each position's output.
    y_off = (
        torch.einsum("clhn,chpn->clhp", C, entering) * torch.exp(A_cum).permute(1, 2, 0)[..., None]
    )
    y = (y_diag + y_off).reshape(-1, H, P)[:T] + skip
    return y, final


def ssd_step(state, x, dt, A, B, C, D):
    """One token for each of a batch: state [b,H,P,N] (float32), x [b,H,P], dt [b,H],
    B/C [b,G,N]. Returns (y [b,H,P] float32, new_state)."""
    rep = x.shape[1] // B.shape[1]
    x, dt = x.float(), dt.float()
    B = B.float().repeat_interleave(rep, dim=1)
    C = C.float().repeat_interleave(rep, dim=1)
    dA = torch.exp(dt * A.float())[..., None, None]
    dBx = (dt[..., None] * B)[:, :, None, :] * x[..., None]
    state = state.float() * dA + dBx
    y = torch.einsum("bhpn,bhn->bhp", state, C) + D.float()[:, None] * x
    return y, state
