"""A Mamba2 layer over the positions of a speculative verify pass (`Mamba2Mixer.
verify_positions`), on the reference path (the fast path takes the step kernel).

`stepwise`: `Mamba2Mixer.decode`'s operations, in_proj, dt, gated norm and out_proj over
every row at once, the conv window and SSM step once per position, in place on the live
slots, the state saved after each position where the pass asks.

`uniform`, when every request verifies the same number m of positions (batch 1 always;
chains, not trees): the conv window and the SSD step's row-wise inputs for all m positions
at once, then only the recurrence position by position.

    window   [conv state (K-1 columns), x_0 .. x_{m-1}]: one `_conv` over it gives the m
             outputs one-window steps give (the same K multiply-adds per output, in order);
             the conv state after position j is window[:, :, j+1 : j+K]
    ssd      dA = exp(dt A), dt B, dt B x (reference path) and D x for every position in one
             op each; per position only state * dA + dBx and state @ C (`ssd_steps_`)
    scratch  the state after position j (j < m-1) is written straight into the request's
             scratch slot j (no copy out of the live slot afterwards)

Why: at batch 1 a K=3 verify pass ran ~35 small ops per position and Mamba layer (4 x 12 on
the bench 100m model), about 15 ms a step beyond the extra rows' matmuls; this runs ~8.
Exactness (`uniform`): every op is elementwise (the same values, the same IEEE roundings, whatever the
shape) except `silu` and `softplus`, whose vectorised and scalar tails round differently:
`_conv`'s silu sees whole multiples of 64 elements here (`fits` asks conv_dim % 64 == 0), as
it does in a one-window step. float32 pools only (a narrower pool rounds the state between
positions in the loop this replaces). tests/unit/engine/speculative/test_speculative.py checks every verify
row against plain decode bit for bit.
"""

from __future__ import annotations

import torch

from baton.model.layers.linear import decode_path
from baton.model.layers.ssd import ssd_step_

LANES = 64
"""conv_dim must be a multiple of this: no element falls in a kernel's scalar tail."""


def fits(mixer, ctx, counts: list[int], tree: bool) -> bool:
    """Whether a pass can take `uniform`: a chain, one count for every request, float32."""
    if tree or len(set(counts)) != 1 or mixer.cfg.conv_dim % LANES:
        return False
    return all(ctx.state(mixer.layer_idx, n).dtype == torch.float32 for n in mixer.state_names)


def ssd_steps_(state, x, dt, A, B, C, D, save=None) -> torch.Tensor:
    """m consecutive `ssd_step_`s (baton/model/layers/ssd.py) with their row-wise parts done
    once: state [b, H, P, N] float32 (updated in place to the state after the last step),
    x [b, m, H, P], dt [b, m, H], B/C [b, m, G, N]. `save(j, state)` runs after each step but
    the last. Returns y [b, m, H, P]. The same operations per step as `ssd_step_`."""
    m = x.shape[1]
    rep = x.shape[2] // B.shape[2]
    x, dt = x.float(), dt.float()
    B = B.float().repeat_interleave(rep, dim=2)
    C = C.float().repeat_interleave(rep, dim=2)
    dA = torch.exp(dt * A.float())[..., None, None]
    dtB = (dt[..., None] * B)[:, :, :, None, :]
    fast = decode_path() == "fast"
    dBx = None if fast else dtB * x[..., None]
    Dx = D.float()[:, None] * x
    ys = []
    for j in range(m):
        if fast:  # ssd_step_'s fast branch: addcmul_ (an FMA) instead of the dBx temporary
            state.mul_(dA[:, j]).addcmul_(dtB[:, j], x[:, j, ..., None])
        else:
            state.mul_(dA[:, j]).add_(dBx[:, j])
        ys.append(torch.matmul(state, C[:, j, ..., None])[..., 0] + Dx[:, j])
        if save is not None and j < m - 1:
            save(j, state)
    return torch.stack(ys, dim=1)


def uniform(mixer, x: torch.Tensor, per_pos, m: int) -> torch.Tensor:
    """`stepwise` for a pass that `fits`: rows request-major, m per request."""
    cfg = mixer.cfg
    H, P, G, N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    ctx = per_pos[0].ctx
    b = x.shape[0] // m
    gate, xbc, dt = mixer._split(mixer.in_proj(x))
    dt = mixer._dt(dt)
    in_place = ctx.slot_range is not None
    conv, ssm = mixer._live_states(ctx, in_place)
    K1 = conv.shape[-1]
    window = torch.cat([conv.to(xbc.dtype), xbc.reshape(b, m, -1).transpose(1, 2)], dim=-1)
    xs, B, C = mixer._ssm_inputs(mixer._conv(window).transpose(1, 2))
    conv_pool, ssm_pool = (ctx.state(mixer.layer_idx, n) for n in mixer.state_names)

    def save(j: int, state: torch.Tensor) -> None:
        dst = per_pos[j].save_to
        conv_pool.index_copy_(0, dst, window[:, :, j + 1 : j + 1 + K1])
        d = dst.tolist()
        if d == list(range(d[0], d[0] + len(d))):  # state may be a view of the same pool
            ssm_pool[d[0] : d[0] + len(d)].copy_(state)
        else:
            ssm_pool.index_copy_(0, dst, state.clone() if in_place else state)

    y = ssd_steps_(ssm, xs.reshape(b, m, H, P), dt.view(b, m, H), mixer._A(),
                   B.reshape(b, m, G, N), C.reshape(b, m, G, N), mixer.D, save)
    conv.copy_(window[:, :, m:])
    if not in_place:
        mixer._write_back(ctx, conv, ssm)
    return mixer._out(y.reshape(b * m, H * P), gate, x.dtype)


def stepwise(mixer, x: torch.Tensor, per_pos) -> torch.Tensor:
    """`Mamba2Mixer.decode`, operation for operation, over the positions of a verify pass:
    in_proj, dt, gated norm and out_proj are row-wise (all rows in one call); the conv
    window and the SSM state advance one position at a time."""
    cfg = mixer.cfg
    H, P, G, N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    gate, xbc, dt = mixer._split(mixer.in_proj(x))
    dt = mixer._dt(dt)
    A = mixer._A()
    y_all = None
    for p in per_pos:
        ctx = p.ctx
        if p.copy_from is not None:
            mixer.save_state(ctx, p.copy_from, ctx.slots)
        in_place = ctx.slot_range is not None and \
            ctx.state(mixer.layer_idx, mixer.state_names[1]).dtype == torch.float32
        conv, ssm = mixer._live_states(ctx, in_place)
        xb = xbc.index_select(0, p.rows)
        b = xb.shape[0]
        window = torch.cat([conv.to(xb.dtype), xb[:, :, None]], dim=-1)
        xs, B, C = mixer._ssm_inputs(mixer._conv(window)[..., 0])
        conv.copy_(window[:, :, 1:])
        y = ssd_step_(ssm, xs.reshape(b, H, P), dt.index_select(0, p.rows), A,
                      B.reshape(b, G, N), C.reshape(b, G, N), mixer.D)
        if not in_place:
            mixer._write_back(ctx, conv, ssm)
        if y_all is None:
            y_all = y.new_empty((x.shape[0], H * P))
        y_all.index_copy_(0, p.rows, y.reshape(b, -1))
        if p.save_to is not None:
            mixer.save_state(ctx, p.save_slots, p.save_to)
    return mixer._out(y_all, gate, x.dtype)
