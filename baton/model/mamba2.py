"""The `M` layer of NemotronH: the Mamba2 mixer, reading and writing its state in the pool.

in_proj splits into   [ gate z | x | B | C | dt ]   (widths: inter, inter, G*N, G*N, H)
                                 \\_ conv input _/
The conv state holds the last `conv_kernel - 1` conv inputs per channel, sections [x | B | C].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.config import ModelConfig
from baton.model.norms import GatedRMSNorm
from baton.model.paged import StepContext
from baton.model.ssd import ssd_scan, ssd_step


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
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
        """h [T, hidden] of one sequence; resumes from (or, if fresh, replaces) its slot's state."""
        cfg, T = self.cfg, h.shape[0]
        conv_state = ctx.conv(self.layer_idx)[ctx.slot]
        ssm_state = ctx.ssm(self.layer_idx)[ctx.slot]
        gate, xbc, dt = self._split(self.in_proj(h))
        prev = torch.zeros_like(conv_state) if ctx.fresh else conv_state
        window = torch.cat([prev.to(xbc.dtype), xbc.T], dim=-1)  # [conv_dim, K-1+T]
        conv_state.copy_(window[:, window.shape[-1] - conv_state.shape[-1] :])
        x, B, C = self._ssm_inputs(self._conv(window).T)
        y, final = ssd_scan(
            x.reshape(T, cfg.mamba_num_heads, cfg.mamba_head_dim),
            self._dt(dt),
            self._A(),
            B.reshape(T, cfg.n_groups, cfg.ssm_state_size),
            C.reshape(T, cfg.n_groups, cfg.ssm_state_size),
            self.D,
            cfg.chunk_size,
            None if ctx.fresh else ssm_state,
        )
        ssm_state.copy_(final)
        return self._out(y.reshape(T, -1), gate, h.dtype)

    def decode(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h [B, hidden], one token per sequence; updates the states of `ctx.slots` in place."""
        cfg, b = self.cfg, h.shape[0]
        conv_pool, ssm_pool = ctx.conv(self.layer_idx), ctx.ssm(self.layer_idx)
        gate, xbc, dt = self._split(self.in_proj(h))
        window = torch.cat([conv_pool[ctx.slots].to(xbc.dtype), xbc[:, :, None]], dim=-1)
        conv_pool.index_copy_(0, ctx.slots, window[:, :, 1:].to(conv_pool.dtype))
        x, B, C = self._ssm_inputs(self._conv(window)[..., 0])
        y, state = ssd_step(
            ssm_pool[ctx.slots],
            x.reshape(b, cfg.mamba_num_heads, cfg.mamba_head_dim),
            self._dt(dt),
            self._A(),
            B.reshape(b, cfg.n_groups, cfg.ssm_state_size),
            C.reshape(b, cfg.n_groups, cfg.ssm_state_size),
            self.D,
        )
        ssm_pool.index_copy_(0, ctx.slots, state.to(ssm_pool.dtype))
        return self._out(y.reshape(b, -1), gate, h.dtype)

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
