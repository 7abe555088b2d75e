"""The gated DeltaNet mixer (a `protocol.RecurrentMixer`; Qwen3.5's `linear_attn`), reading and
writing its state in the pool.

    in_proj_qkv -> [ q | k | v ]  (widths HK*dk, HK*dk, HV*dv)  -> causal depthwise conv + SiLU
    in_proj_z   -> z (output gate)   in_proj_b -> beta = sigmoid(b)
    in_proj_a   -> g = -exp(A_log) * softplus(a + dt_bias)   (log decay, float32)
Two state tensors per slot (named by `state_names`): `conv` (the last K-1 conv inputs per
channel, sections [q | k | v]) and `recurrent` [HV, dk, dv] (float32 unless the checkpoint asks
otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.layers import fused, linear, step_kernels
from baton.model.layers.gated_norms import HeadGatedRMSNorm
from baton.model.layers.gdn import chunk_scan, recurrent_step_
from baton.model.layers.gdn_fast import chunk_scan_fast
from baton.model.paged import StepContext
from baton.model.protocol import RecurrentMixer


class GatedDeltaNet(RecurrentMixer):
    has_kernel_step = True

    def __init__(self, cfg, layer_idx: int,
                 state_names: tuple[str, str] = ("conv", "recurrent")):
        super().__init__()
        self.layer_idx = layer_idx
        self.state_names = state_names
        """The pools' names of its (conv window [conv_dim, K-1], recurrent [HV, dk, dv])."""
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.sections = list(cfg.conv_sections)
        self.chunk = cfg.chunk_size
        C, H = cfg.conv_dim, cfg.hidden_size
        self.in_proj_qkv = nn.Linear(H, C, bias=False)
        self.in_proj_z = nn.Linear(H, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.hv, bias=False)
        self.in_proj_a = nn.Linear(H, self.hv, bias=False)
        self.conv1d = nn.Conv1d(C, C, cfg.linear_conv_kernel_dim, groups=C, bias=False)
        # Kept in float32 by the loader whatever the model dtype: they set every decay rate.
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = HeadGatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(cfg.value_dim, H, bias=False)

    def prefill(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h [n, T, hidden] of n sequences; each resumes from (or, if fresh, replaces) the state
        in its slot."""
        if fused.fast_prefill(h) and self._fast_states(ctx):
            return self._prefill_fast(h, ctx)
        n, T, _ = h.shape
        qkv = self.in_proj_qkv(h)
        conv, rec = self._prefill_states(ctx)
        window = torch.cat([conv.to(qkv.dtype), qkv.transpose(1, 2)], dim=-1)
        q, k, v = self._qkv(self._conv(window).transpose(1, 2), (n, T))
        g, beta = self._gates(h)
        o, final = chunk_scan(q, k, v, g, beta, rec, self.chunk)
        conv_pool, rec_pool = self._pools(ctx)
        tail = window[..., window.shape[-1] - conv_pool.shape[-1]:]
        conv_pool.index_copy_(0, ctx.slots, tail.to(conv_pool.dtype))
        rec_pool.index_copy_(0, ctx.slots, final.to(rec_pool.dtype))
        return self._out(o.to(h.dtype), h)

    def _fast_states(self, ctx: StepContext) -> bool:
        return all(t.dtype == torch.float32 for t in self._pools(ctx)) \
            and self.conv1d.weight.dtype == torch.float32

    def _pools(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (conv, recurrent) state tensors [num_slots, ...] in the pools."""
        return ctx.state(self.layer_idx, self.state_names[0]), \
            ctx.state(self.layer_idx, self.state_names[1])

    def _prefill_fast(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """`prefill` on the fast path: the conv and gated norm in one kernel pass each over the
        token-major rows (`step_kernels` prefill.cpp), the scan `chunk_scan_fast`."""
        n, T, _ = h.shape
        k = step_kernels.kernels()
        qkv = self.in_proj_qkv(h)
        conv, rec = self._prefill_states(ctx)
        q, kk, v = self._qkv(k.conv_silu(qkv, conv, self.conv1d.weight[:, 0], None), (n, T))
        g, beta = self._gates(h)
        o, final = chunk_scan_fast(q, kk, v, g, beta, rec, self.chunk)
        conv_pool, rec_pool = self._pools(ctx)
        K1 = conv_pool.shape[-1]  # the window's last K-1 columns: the next call's state
        tail = (qkv[:, T - K1:].transpose(1, 2) if T >= K1
                else torch.cat([conv[..., T:], qkv.transpose(1, 2)], dim=-1))
        conv_pool.index_copy_(0, ctx.slots, tail)
        rec_pool.index_copy_(0, ctx.slots, final)
        if type(self.norm) is not HeadGatedRMSNorm:
            return self._out(o, h)
        z = self.in_proj_z(h)
        o = k.gated_rms_norm(o.view(n * T, -1), z.view(n * T, -1), self.norm.weight,
                             self.dv, self.norm.eps, True)
        return self.out_proj(o.view(n, T, -1))

    def decode(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h [b, hidden], one token per sequence; updates the states of `ctx.slots`."""
        b = h.shape[0]
        conv_pool, rec_pool = self._pools(ctx)
        if fused.fast_decoding(h) and conv_pool.dtype == rec_pool.dtype == torch.float32:
            return self.out_proj(self._fused_step(h, ctx, conv_pool, rec_pool))
        qkv = self.in_proj_qkv(h)
        in_place = ctx.slot_range is not None
        conv = conv_pool[ctx.slot_range] if in_place else conv_pool.index_select(0, ctx.slots)
        window = torch.cat([conv.to(qkv.dtype), qkv[:, :, None]], dim=-1)
        q, k, v = self._qkv(self._conv_step(window), (b,))
        conv.copy_(window[:, :, 1:])
        g, beta = self._gates(h)
        live = in_place and rec_pool.dtype == torch.float32
        rec = rec_pool[ctx.slot_range] if live else rec_pool.index_select(0, ctx.slots).float()
        o = recurrent_step_(rec, q, k, v, g, beta)
        if not in_place:
            conv_pool.index_copy_(0, ctx.slots, conv)
        if not live:
            rec_pool.index_copy_(0, ctx.slots, rec.to(rec_pool.dtype))
        return self._out(o.to(h.dtype), h)

    def _fused_step(self, h, ctx: StepContext, conv_pool, rec_pool) -> torch.Tensor:
        """The fast path's decode step between the projections: the C++ step kernel on the
        pools' slot rows in place (`step_kernels`), or where it is not built the compiled
        `fused.deltanet_step` on the live slots (views when consecutive, else gathered)."""
        if step_kernels.kernels() is not None:  # in place in the pools' slot rows
            return self.kernel_step(self.kernel_inputs(h), ctx, ctx.slots, ctx.slots)
        qkv, a, beta, z = self.kernel_inputs(h)
        in_place = ctx.slot_range is not None
        if in_place:
            conv, rec = conv_pool[ctx.slot_range], rec_pool[ctx.slot_range]
        else:
            conv, rec = conv_pool.index_select(0, ctx.slots), rec_pool.index_select(0, ctx.slots)
        dims = (self.hk, self.hv, self.dk, self.dv, self.norm.eps)
        o = fused.run("deltanet", dims, qkv, conv, rec, a, beta, z, self.conv1d.weight[:, 0],
                      self.dt_bias, self.A_log, self.norm.weight)
        if not in_place:
            conv_pool.index_copy_(0, ctx.slots, conv)
            rec_pool.index_copy_(0, ctx.slots, rec)
        return o

    def kernel_inputs(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rows the step kernel reads (`kernel_step`): qkv, a, b and z's projections, on
        the fast path in one kernel call (`linear.fused_linears`; the step kernel reads
        contiguous rows: copies of the column views, none at batch 1)."""
        outs = linear.fused_linears(h, self.in_proj_qkv, self.in_proj_a, self.in_proj_b,
                                    self.in_proj_z)
        if outs is None:
            return (self.in_proj_qkv(h), self.in_proj_a(h), self.in_proj_b(h), self.in_proj_z(h))
        return tuple(o.contiguous() for o in outs)

    def kernel_step(self, inputs: tuple[torch.Tensor, ...], ctx: StepContext,
                    src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """The C++ step kernel over rows `inputs` (`kernel_inputs`): each row's state read
        from slot src[i] and the next one written to slot dst[i] (the same slots in decode;
        a verify pass's next position elsewhere); returns the gated-normed output."""
        qkv, a, b, z = inputs
        return step_kernels.kernels().deltanet_step(
            qkv, *self._pools(ctx), src, dst, a, b, z, self.conv1d.weight[:, 0], self.dt_bias, self.A_log, self.norm.weight,
            self.hk, self.hv, self.dk, self.dv, self.norm.eps)

    def _prefill_states(self, ctx: StepContext):
        """(conv, recurrent) the n sequences start from: their slots', zeros where fresh (a
        fresh slot is never read: it may hold a finished request's state)."""
        conv_pool, rec_pool = self._pools(ctx)
        n = len(ctx.fresh)
        if all(ctx.fresh):
            return conv_pool.new_zeros((n, *conv_pool.shape[1:])), None
        conv, rec = conv_pool.index_select(0, ctx.slots), rec_pool.index_select(0, ctx.slots)
        if any(ctx.fresh):
            stale = torch.tensor(ctx.fresh, device=conv.device)
            conv[stale], rec[stale] = 0, 0
        return conv, rec.float()

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv + SiLU: window [b, C, K-1+n] -> [b, C, n], the op transformers
        runs (so its rounding: an error the scan would amplify)."""
        w = self.conv1d.weight.to(window.dtype)
        return F.silu(F.conv1d(window, w, groups=w.shape[0]))

    def _conv_step(self, window: torch.Tensor) -> torch.Tensor:
        """The conv + SiLU of one new token per sequence: window [b, C, K] -> [b, C], as K
        multiply-adds (a conv kernel call costs more than the whole sum at this size)."""
        w = self.conv1d.weight[:, 0].to(window.dtype)
        out = window[..., 0] * w[:, 0]
        for j in range(1, w.shape[1]):
            out = out + window[..., j] * w[:, j]
        return F.silu(out)

    def _qkv(self, x: torch.Tensor, lead: tuple[int, ...]):
        q, k, v = x.split(self.sections, dim=-1)
        return (q.reshape(*lead, self.hk, self.dk), k.reshape(*lead, self.hk, self.dk),
                v.reshape(*lead, self.hv, self.dv))

    def _gates(self, h: torch.Tensor):
        beta = self.in_proj_b(h).sigmoid()
        a = self.in_proj_a(h).float()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        return g, beta

    def _out(self, o: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """o [..., HV, dv] -> gated norm per head with z -> out_proj."""
        z = self.in_proj_z(h)
        return self.out_proj(self.norm(o.reshape(z.shape), z))
