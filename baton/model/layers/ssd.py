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

from baton.model.layers.linear import decode_path


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = a[..., j+1] + ... + a[..., i] for j <= i, -inf above the diagonal.

    Built from a masked cumsum rather than cumsum differences, which lose precision.
    """
    n = a.size(-1)
    ones = torch.ones(n, n, dtype=torch.bool, device=a.device)
    out = torch.cumsum(a[..., None].expand(*a.shape, n).masked_fill(~ones.tril(-1), 0), dim=-2)
    return out.masked_fill_(~ones.tril(0), -torch.inf)


def _head_chunks(t: torch.Tensor, heads: int, chunk: int) -> torch.Tensor:
    """[b, T, g, X] -> [b, heads, T/chunk, chunk, X], head h reading group h // (heads/g).

    One pass into a zeroed buffer: the padding past T has zero dt, which leaves the state
    alone; the head-major layout makes every contraction of the scan a plain batched matmul.
    """
    b, T, g, X = t.shape
    out = t.new_zeros(b, heads, -(-T // chunk) * chunk, X)
    out.view(b, g, heads // g, -1, X)[:, :, :, :T] = t.transpose(1, 2)[:, :, None]
    return out.view(b, heads, -1, chunk, X)


def ssd_scan(x, dt, A, B, C, D, chunk: int, state: torch.Tensor | None = None):
    """Run the recurrence over T tokens from `state` (zeros if None); return (y, final_state).

    Takes one sequence ([T, ...] inputs, state [H, P, N]) or a batch of equally long ones
    (a leading b on every input and on the state). Computed in float32 whatever the input
    dtype. Intermediates are [b, h, c, l, ...]: c chunk, l/s position in a chunk.
    """
    if x.dim() == 3:
        one = None if state is None else state[None]
        y, final = ssd_scan(x[None], dt[None], A, B[None], C[None], D, chunk, one)
        return y[0], final[0]
    b, T, H, P = x.shape
    N = B.shape[-1]
    x, dt = x.float(), dt.float()
    xdt = _head_chunks(x * dt[..., None], H, chunk)  # [b, h, c, l, p]
    Bh, Ch = (_head_chunks(t.float(), H, chunk) for t in (B, C))  # [b, h, c, l, n]
    Adt = _head_chunks((A.float() * dt)[..., None], H, chunk)[..., 0]  # [b, h, c, l]
    A_cum = torch.cumsum(Adt, dim=-1)
    # 1. within each chunk: attention-like quadratic form with a decay mask.
    y = (Ch @ Bh.transpose(-1, -2)).mul_(segment_sum(Adt).exp_()) @ xdt
    # 2. the state each chunk adds by its end: [b, h, c, p, n].
    decay_to_end = torch.exp(A_cum[..., -1:] - A_cum)
    chunk_states = xdt.transpose(-1, -2) @ (Bh * decay_to_end[..., None])
    # 3. carry states across chunks: the state entering chunk i, and the final state.
    init = chunk_states.new_zeros(b, H, 1, P, N) if state is None else state.float()[:, :, None]
    chunk_states = torch.cat([init, chunk_states], dim=2).flatten(-2)
    decay_chunk = segment_sum(F.pad(A_cum[..., -1], (1, 0))).exp_()  # [b, h, i, j]
    states = (decay_chunk @ chunk_states).view(b, H, -1, P, N)
    entering, final = states[:, :, :-1], states[:, :, -1]
    # 4. what the entering state contributes to each position's output.
    y += (Ch @ entering.transpose(-1, -2)) * torch.exp(A_cum)[..., None]
    y = y.view(b, H, -1, P)[:, :, :T].transpose(1, 2)
    return y + D.float()[:, None] * x, final


def ssd_step(state, x, dt, A, B, C, D):
    """One token for each of a batch: state [b,H,P,N], x [b,H,P], dt [b,H], B/C [b,G,N].
    Returns (y [b,H,P] float32, new float32 state); `state` is left as it was."""
    new = state.to(torch.float32, copy=True)
    return ssd_step_(new, x, dt, A, B, C, D), new


def ssd_step_(state, x, dt, A, B, C, D):
    """`ssd_step` that updates the float32 `state` in place (a view of the pool, say) and
    returns y; the same operations in the same order, so the same rounding."""
    rep = x.shape[1] // B.shape[1]
    x, dt = x.float(), dt.float()
    B = B.float().repeat_interleave(rep, dim=1)
    C = C.float().repeat_interleave(rep, dim=1)
    dA = torch.exp(dt * A.float())[..., None, None]
    if decode_path() == "fast":
        # Two passes over the state instead of four (no [b, H, P, N] dBx temporary): a fifth
        # less time at batch 32, where the state dominates decode. addcmul_ fuses the
        # product into the add (FMA), so it rounds differently from the reference (<= 1 ulp).
        state.mul_(dA).addcmul_((dt[..., None] * B)[:, :, None, :], x[..., None])
    else:
        dBx = (dt[..., None] * B)[:, :, None, :] * x[..., None]
        state.mul_(dA).add_(dBx)
    return torch.matmul(state, C[..., None])[..., 0] + D.float()[:, None] * x
