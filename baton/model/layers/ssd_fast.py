"""The fast path's Mamba2 prefill scan (`ssd_scan_fast`): the recurrence of `baton.model.
layers.ssd`, the same closed form chunk by chunk, with less work than the reference's scan:
- C B^T per group (B and C are shared by the r = H/G heads of a group): 1/r of the FLOPs,
  and B and C are never copied per head;
- the decay mask in one kernel pass (`step_kernels` ssd_decay) instead of a masked cumsum
  over an [l, l] expansion and four more passes: the differences of one float64 cumsum,
  as precise (float64 leaves no cancellation for float32 inputs);
- each chunk's whole output one matmul, [M | C_t decay(start -> t)] @ [x dt ; S^T] (the
  state carry writes the second factor): no separate matmul and no strided add for what the
  entering state gives. Where the head size is a multiple of 16 the first factor never goes
  to memory (`step_kernels` decay_matmul: each block's rows into a buffer in cache, then
  straight into its matmul, M's zero triangle skipped), the same bits as MKL's product on the
  bench model's shapes;
- 64-token chunks (the checkpoint's are 128): the intra-chunk terms cost T * l per head, the
  carried states T / l; on CPU 64 is the cheaper side of that trade (`CHUNK`);
- the states carried in order, one multiply-add a chunk, instead of a [c+1, c+1] matmul
  over every chunk pair (`step_kernels` ssd_carry: one pass for every chunk, with
  torch.addcmul's rounding; `_carry` where the kernels are not built); decays below e^FLUSH
  are 0 (denormals, see FLUSH);
- float32 denormals flushed to zero while it runs (`denormals_flushed`): not the inputs, but
  the chunk products' partial sums (decays down to e^FLUSH times small states) still make
  them, and every multiply that meets one takes a microcode assist. A denormal is below
  1.2e-38, under half an ulp of any output above ~1e-31, so the outputs keep their bits
  unless they are themselves that small.
It rounds differently from the reference (about 1e-6), so it runs only on the fast path.
Measured figures: docs/performance.md.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from baton.model.layers import step_kernels

CHUNK = 64
"""Tokens per chunk of the fast scan (independent of the checkpoint's `chunk_size`: the
closed form is exact for any)."""
FLUSH = -60.0
"""Decays below e^FLUSH (~1e-26) are 0: their products would be float32 denormals, which
slowed the scan's matmuls and multiplies by a third on the bench model, and they weigh less
than float32 can resolve beside the undecayed terms every output and state has."""


def _decay(cum64: torch.Tensor) -> torch.Tensor:
    """L[..., i, j] = exp(cum[i] - cum[j]) for j <= i, 0 above the diagonal: [..., l, l]."""
    # Above the diagonal the exponent is positive (it may overflow to inf): zeroed after.
    return _exp(cum64[..., :, None] - cum64[..., None, :]).tril_()


def _exp(x64: torch.Tensor) -> torch.Tensor:
    """exp of float64 exponents, in float32, 0 below e^FLUSH (see FLUSH)."""
    x = x64.float()
    return x.masked_fill_(x < FLUSH, -torch.inf).exp_()


@contextmanager
def denormals_flushed():
    """Flush-to-zero and denormals-are-zero on every thread of torch's pool for the block
    (`step_kernels` flush_denormals), as they were after; nothing where the kernels are not
    built."""
    k = step_kernels.kernels()
    was = True if k is None else k.flush_denormals(True)
    try:
        yield
    finally:
        if not was:
            k.flush_denormals(False)


def ssd_scan_fast(x, dt, A, B, C, D, state: torch.Tensor | None = None, chunk: int = CHUNK):
    """`ssd_scan` of a batch of equally long sequences: x [b, T, H, P], dt [b, T, H] (float32),
    B, C [b, T, G, N], state [b, H, P, N] or None (zeros). Returns (y [b, T, H, P], final
    state [b, H, P, N]), float32. Intermediates: [b, G, r, c, L, P] head-major (head g*r + j),
    [b, G, c, L, r*P] group-major (a group's heads side by side: one wide matmul a group)."""
    with denormals_flushed():
        return _scan(x, dt, A, B, C, D, state, chunk)


def _scan(x, dt, A, B, C, D, state, chunk):
    b, T, H, P = x.shape
    G, N = B.shape[-2:]
    r, L = H // G, chunk
    c = -(-T // L)
    x, dt = x.float(), dt.float()
    if T % L:  # whole chunks: the padding has dt = 0 (no decay, no input)
        pad = c * L - T
        x, dt = F.pad(x, (0, 0, 0, 0, 0, pad)), F.pad(dt, (0, 0, 0, pad))
        B, C = F.pad(B, (0, 0, 0, 0, 0, pad)), F.pad(C, (0, 0, 0, 0, 0, pad))
    # X: per head and chunk the rows [x dt (L rows) ; state entering the chunk, transposed
    # (N rows)]: with [M | C decay] (`_intra`) the chunk's whole output is one matmul.
    X = x.new_empty(b, H, c, L + N, P)
    xdt = X[:, :, :, :L]
    torch.mul(_chunks(x, c), _chunks(dt[..., None], c), out=xdt)
    Bg, Cg = (_chunks(t.float(), c).contiguous() for t in (B, C))  # [b, G, c, L, N]
    cum64 = _chunks(dt.double()[..., None] * A.double()[:, None], c)[..., 0].cumsum(-1)
    # 1. the state each chunk adds by its end, sum_t B_t (decay(t -> end) xdt_t)^T, group-major
    # [b, G, c, N, r*P] (the state transposed, heads side by side).
    to_end = _heads_last(_exp(cum64[..., -1:] - cum64), G)  # [b, G, c, L, r, 1]
    xs = x.new_empty(b, G, c, L, r, P)
    torch.mul(xdt.view(b, G, r, c, L, P).permute(0, 1, 3, 4, 2, 5), to_end, out=xs)
    states = (Bg.transpose(-1, -2) @ xs.view(b, G, c, L, r * P)).view(b, G, c, N, r, P)
    # 2. carried in order: the state entering each chunk (into X), and the final one.
    k = step_kernels.kernels()
    decay, state = _exp(cum64[..., -1]).contiguous(), None if state is None else state.float()
    if k is not None:  # one pass (`ssd_carry`), the same rounding as the loop in `_carry`
        final = k.ssd_carry(states, decay, X, state, L)
    else:
        final = _carry(states, decay, X, state, L)
    # 3. every output: [M | C decay(start -> t)] @ [x dt ; S^T], then D x.
    if k is not None and P % 16 == 0:  # the decay matrix never in memory (`decay_matmul`)
        y = k.decay_matmul(Cg @ Bg.transpose(-1, -2), cum64, r, Cg, X)  # [b, H, c, L, P]
    else:
        y = _intra(Cg, Bg, cum64, r) @ X
    y = y.permute(0, 2, 3, 1, 4).reshape(b, c * L, H, P)[:, :T]  # token-major (a view)
    out = x.new_empty(b, T, H, P)  # contiguous (an op's own output may take y's strides)
    torch.addcmul(y, x[:, :T], D.float()[:, None], out=out)  # one pass: y + D x
    return out, final


def _carry(states, decay, X, state, L):
    """`ssd_carry` in torch: states [b, G, c, N, r, P], decay [b, H, c], X [b, H, c, L + N, P]
    (rows L.. written), state [b, H, P, N] or None; returns the final state [b, H, P, N]."""
    b, G, c, N, r, P = states.shape
    decay = decay.view(b, G, r, c).permute(0, 1, 3, 2)[..., None, :, None]
    entering = X[:, :, :, L:].view(b, G, r, c, N, P).permute(0, 1, 3, 4, 2, 5)
    if state is None:
        entering[:, :, 0] = 0
    else:
        entering[:, :, 0] = state.view(b, G, r, P, N).permute(0, 1, 4, 2, 3)
    for i in range(c - 1):
        torch.addcmul(states[:, :, i], entering[:, :, i], decay[:, :, i],
                      out=entering[:, :, i + 1])
    # the same op as the carry: a longer call carries these bits into its next chunk
    final = torch.addcmul(states[:, :, -1], entering[:, :, -1], decay[:, :, -1])  # [b,G,N,r,P]
    return final.permute(0, 1, 3, 4, 2).reshape(b, G * r, P, N)


def _intra(Cg, Bg, cum64, r: int) -> torch.Tensor:
    """[M | C_t exp(cum_t)] per head and chunk, [b, H, c, L, L + N]: M = (C B^T, per group) x
    the decay (`_decay`)."""
    CB = Cg @ Bg.transpose(-1, -2)  # [b, G, c, L, L]
    k = step_kernels.kernels()
    if k is not None:  # one pass instead of eight
        return k.ssd_decay(CB, cum64, r, Cg)
    b, G, c, L, N = Cg.shape
    M = _decay(cum64).view(b, G, r, c, L, L).mul_(CB[:, :, None])
    e = _exp(cum64).view(b, G, r, c, L, 1)
    return torch.cat([M, Cg[:, :, None] * e], dim=-1).view(b, G * r, c, L, L + N)


def _chunks(t: torch.Tensor, c: int) -> torch.Tensor:
    """[b, c*L, X, Y] -> [b, X, c, L, Y] (a view)."""
    b, T, X, Y = t.shape
    return t.view(b, c, T // c, X, Y).permute(0, 3, 1, 2, 4)


def _heads_last(t: torch.Tensor, G: int) -> torch.Tensor:
    """[b, H, c, L] -> [b, G, c, L, r, 1] (a view)."""
    b, H, c, L = t.shape
    return t.view(b, G, H // G, c, L).permute(0, 1, 3, 4, 2)[..., None]
