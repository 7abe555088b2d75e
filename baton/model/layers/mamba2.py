"""The Mamba2 mixer (a `protocol.RecurrentMixer`), reading and writing its state in the pool.

in_proj splits into   [ gate z | x | B | C | dt ]   (widths: inter, inter, G*N, G*N, H)
                                 \\_ conv input _/
The conv state holds the last `conv_kernel - 1` conv inputs per channel, sections [x | B | C].
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.layers import fused, mamba2_verify, step_kernels
from baton.model.layers.norms import GatedRMSNorm
from baton.model.layers.ssd import ssd_scan, ssd_step_
from baton.model.layers.ssd_fast import ssd_scan_fast
from baton.model.paged import StepContext
from baton.model.protocol import RecurrentMixer, VerifyPosition


class Mamba2Dims(Protocol):
    """What the layer reads of a model config (any family's)."""

    hidden_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    mamba_intermediate: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    conv_dim: int
    conv_sections: tuple[int, int, int]
    chunk_size: int
    use_bias: bool
    use_conv_bias: bool
    layer_norm_epsilon: float
    dt_limit: tuple[float, float]


class Mamba2Mixer(RecurrentMixer):
    has_kernel_step = True

    def __init__(self, cfg: Mamba2Dims, layer_idx: int,
                 state_names: tuple[str, str] = ("conv", "ssm")):
        super().__init__()
        self.layer_idx = layer_idx
        self.state_names = state_names
        """The pools' names of its (conv window [conv_dim, K-1], SSM state [H, P, N])."""
        self.cfg = cfg
        inter, conv_dim, H = cfg.mamba_intermediate, cfg.conv_dim, cfg.mamba_num_heads
        self.in_proj = nn.Linear(cfg.hidden_size, inter + conv_dim + H, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, cfg.conv_kernel, groups=conv_dim, bias=cfg.use_conv_bias
        )
        # Kept in float32 by the loader whatever the model dtype: the scan runs in float32 and
        # these few numbers set every decay rate.
        self.dt_bias = nn.Parameter(torch.zeros(H))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.D = nn.Parameter(torch.ones(H))
        self.norm = GatedRMSNorm(inter, inter // cfg.n_groups, cfg.layer_norm_epsilon)
        self.out_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.use_bias)

    def prefill(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h [n, T, hidden] of n sequences; each resumes from (or, if fresh, replaces) the state
        in its slot."""
        if fused.fast_prefill(h) and self._fusable(ctx) and self.conv1d.weight.dtype == h.dtype:
            return self._prefill_fast(h, ctx)
        cfg, (n, T, _) = self.cfg, h.shape
        gate, xbc, dt = self._split(self.in_proj(h))
        conv_state, ssm_state = self._prefill_states(ctx)
        window = torch.cat([conv_state.to(xbc.dtype), xbc.transpose(1, 2)], dim=-1)
        x, B, C = self._ssm_inputs(self._conv(window).transpose(1, 2))
        y, final = ssd_scan(
            x.reshape(n, T, cfg.mamba_num_heads, cfg.mamba_head_dim),
            self._dt(dt),
            self._A(),
            B.reshape(n, T, cfg.n_groups, cfg.ssm_state_size),
            C.reshape(n, T, cfg.n_groups, cfg.ssm_state_size),
            self.D,
            cfg.chunk_size,
            ssm_state,
        )
        conv_pool, ssm_pool = self._pools(ctx)
        tail = window[..., window.shape[-1] - conv_pool.shape[-1] :]
        conv_pool.index_copy_(0, ctx.slots, tail.to(conv_pool.dtype))
        ssm_pool.index_copy_(0, ctx.slots, final.to(ssm_pool.dtype))
        return self._out(y.reshape(n, T, -1), gate, h.dtype)

    def _prefill_fast(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """`prefill` on the fast path: the conv and gated norm in one kernel pass each over the
        token-major rows (`step_kernels` prefill.cpp), the scan `ssd_scan_fast`."""
        cfg, (n, T, _) = self.cfg, h.shape
        k = step_kernels.kernels()
        gate, xbc, dt = self._split(self.in_proj(h))
        conv_state, ssm_state = self._prefill_states(ctx)
        x, B, C = self._ssm_inputs(k.conv_silu(xbc, conv_state, self.conv1d.weight[:, 0],
                                               self.conv1d.bias))
        H, P, G, N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
        y, final = ssd_scan_fast(x.view(n, T, H, P), self._dt(dt), self._A(),
                                 B.view(n, T, G, N), C.view(n, T, G, N), self.D,
                                 None if all(ctx.fresh) else ssm_state)
        conv_pool, ssm_pool = self._pools(ctx)
        K1 = conv_pool.shape[-1]  # the window's last K-1 columns: the next call's state
        tail = (xbc[:, T - K1:].transpose(1, 2) if T >= K1
                else torch.cat([conv_state[..., T:], xbc.transpose(1, 2)], dim=-1))
        conv_pool.index_copy_(0, ctx.slots, tail)
        ssm_pool.index_copy_(0, ctx.slots, final)
        if type(self.norm) is not GatedRMSNorm:  # tensor parallel's all-reduced norm
            return self._out(y.view(n, T, -1), gate, h.dtype)
        y = k.gated_rms_norm(y.view(n * T, -1), gate.reshape(n * T, -1), self.norm.weight,
                             self.norm.group_size, self.norm.eps, False)
        return self.out_proj(y.view(n, T, -1))

    def _prefill_states(self, ctx: StepContext):
        """(conv, ssm) states the n sequences start from: their slots', zeros where fresh."""
        conv_pool, ssm_pool = self._pools(ctx)
        n = len(ctx.fresh)
        if all(ctx.fresh):
            # Never read a fresh slot: it may hold a finished request's state (or garbage).
            conv = conv_pool.new_zeros((n, *conv_pool.shape[1:]))
            return conv, ssm_pool.new_zeros((n, *ssm_pool.shape[1:]))
        conv, ssm = conv_pool.index_select(0, ctx.slots), ssm_pool.index_select(0, ctx.slots)
        if any(ctx.fresh):
            stale = torch.tensor(ctx.fresh, device=conv.device)
            conv[stale], ssm[stale] = 0, 0
        return conv, ssm

    def decode(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h [B, hidden], one token per sequence; updates the states of `ctx.slots` in place."""
        cfg, b = self.cfg, h.shape[0]
        zxbcdt = self.in_proj(h)
        if fused.fast_decoding(zxbcdt) and self._fusable(ctx):
            return self.out_proj(self._fused_step(zxbcdt, ctx))
        gate, xbc, dt = self._split(zxbcdt)
        in_place = ctx.slot_range is not None and self._pools(ctx)[1].dtype == torch.float32
        conv, ssm = self._live_states(ctx, in_place)
        window = torch.cat([conv.to(xbc.dtype), xbc[:, :, None]], dim=-1)
        x, B, C = self._ssm_inputs(self._conv(window)[..., 0])
        conv.copy_(window[:, :, 1:])
        y = ssd_step_(
            ssm,
            x.reshape(b, cfg.mamba_num_heads, cfg.mamba_head_dim),
            self._dt(dt),
            self._A(),
            B.reshape(b, cfg.n_groups, cfg.ssm_state_size),
            C.reshape(b, cfg.n_groups, cfg.ssm_state_size),
            self.D,
        )
        if not in_place:
            self._write_back(ctx, conv, ssm)
        return self._out(y.reshape(b, -1), gate, h.dtype)

    def _fusable(self, ctx: StepContext) -> bool:
        return all(t.dtype == torch.float32 for t in self._pools(ctx))

    def _fused_step(self, zxbcdt: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The fast path's decode step between the projections: the C++ step kernel on the
        pools' slot rows in place (`step_kernels`), or where it is not built the compiled
        `fused.mamba2_step` on the live slots (views when consecutive, else gathered)."""
        cfg, in_place = self.cfg, ctx.slot_range is not None
        lo, hi = cfg.dt_limit
        dims = (cfg.mamba_intermediate, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups,
                cfg.ssm_state_size, float(lo), float(hi), self.norm.group_size, self.norm.eps)
        if step_kernels.kernels() is not None:  # in place in the pools' slot rows
            return self.kernel_step((zxbcdt,), ctx, ctx.slots, ctx.slots)
        conv, ssm = self._live_states(ctx, in_place)
        y = fused.run("mamba2", dims, zxbcdt, conv, ssm, self.conv1d.weight[:, 0],
                      self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight)
        if not in_place:
            self._write_back(ctx, conv, ssm)
        return y

    def kernel_inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rows the step kernel reads (`kernel_step`): in_proj's output."""
        return (self.in_proj(h),)

    def kernel_step(self, inputs: tuple[torch.Tensor, ...], ctx: StepContext,
                    src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """The C++ step kernel over rows `inputs` (`kernel_inputs`): each row's state read
        from slot src[i] and the next one written to slot dst[i] (the same slots in decode;
        a verify pass's next position elsewhere); returns the gated-normed y for out_proj."""
        cfg = self.cfg
        lo, hi = cfg.dt_limit
        return step_kernels.kernels().mamba2_step(
            inputs[0], *self._pools(ctx), src, dst, self.conv1d.weight[:, 0], self.conv1d.bias,
            self.dt_bias, self.A_log, self.D,
            self.norm.weight, cfg.mamba_intermediate, cfg.mamba_num_heads, cfg.mamba_head_dim,
            cfg.n_groups, cfg.ssm_state_size, float(lo), float(hi), self.norm.group_size,
            self.norm.eps)

    def verify_positions(self, x: torch.Tensor, positions: list[VerifyPosition],
                         counts: list[int], tree: bool) -> torch.Tensor:
        """The row-wise parts over every row at once, the recurrence position by position
        (`mamba2_verify`)."""
        if mamba2_verify.fits(self, positions[0].ctx, counts, tree):
            return mamba2_verify.uniform(self, x, positions, counts[0])
        return mamba2_verify.stepwise(self, x, positions)

    def _pools(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (conv, ssm) state tensors [num_slots, ...] in the pools."""
        return ctx.state(self.layer_idx, self.state_names[0]), \
            ctx.state(self.layer_idx, self.state_names[1])

    def _live_states(self, ctx: StepContext, in_place: bool):
        """(conv, ssm) of the batch's slots to update: views of the pools when the slots are
        consecutive (no gather, no scatter), copies otherwise. The SSM state is float32 either
        way, so a low-precision pool is rounded once per step, as in prefill."""
        conv_pool, ssm_pool = self._pools(ctx)
        if in_place:
            return conv_pool[ctx.slot_range], ssm_pool[ctx.slot_range]
        conv = conv_pool.index_select(0, ctx.slots)
        return conv, ssm_pool.index_select(0, ctx.slots).float()

    def _write_back(self, ctx: StepContext, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        conv_pool, ssm_pool = self._pools(ctx)
        conv_pool.index_copy_(0, ctx.slots, conv)
        ssm_pool.index_copy_(0, ctx.slots, ssm.to(ssm_pool.dtype))

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv + silu: window [..., conv_dim, K-1+n] -> [..., conv_dim, n].

        K shifted multiply-adds: no [n, conv_dim, K] intermediate for long prompts, and the same
        formula (so the same rounding) for prefill and the one-window decode step.
        """
        w = self.conv1d.weight[:, 0].to(window.dtype)  # [conv_dim, K]
        K = w.shape[1]
        n = window.shape[-1] - K + 1
        out = window[..., 0:n] * w[:, 0:1]
        for k in range(1, K):
            out = out + window[..., k : k + n] * w[:, k : k + 1]
        if self.conv1d.bias is not None:
            out = out + self.conv1d.bias[:, None]
        return F.silu(out)

    def _split(self, zxbcdt: torch.Tensor):
        cfg = self.cfg
        return zxbcdt.split([cfg.mamba_intermediate, cfg.conv_dim, cfg.mamba_num_heads], dim=-1)

    def _ssm_inputs(self, xbc: torch.Tensor):
        return xbc.split(list(self.cfg.conv_sections), dim=-1)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        lo, hi = self.cfg.dt_limit
        return F.softplus(dt.float() + self.dt_bias.float()).clamp(min=lo, max=hi)

    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def _out(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.out_proj(self.norm(y, gate).to(dtype))
