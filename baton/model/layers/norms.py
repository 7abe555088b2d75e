"""RMS norms: the plain pre-norm and the Mamba2 output's gated, grouped norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.layers import fused, step_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ((fused.fast_decoding(x) or fused.fast_prefill(x))
                and self.weight.dtype == torch.float32):
            k = step_kernels.kernels()
            out = None if k is None else k.rms_norm(x, self.weight, self.eps)
            if out is not None:  # one call instead of seven ops (see step_kernels): a row alone
                return out
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # The weight multiply stays in fp32 and only the result is cast back, as in the reference.
        return (self.weight.float() * x).to(dtype)


class GatedRMSNorm(nn.Module):
    """`norm(x * silu(gate))` with statistics taken over groups of `group_size` channels.

    The groups line up with the Mamba `n_groups`, so a head-sliced (tensor-parallel) shard
    normalises exactly like the whole layer.
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(gate.float())
        shape = x.shape
        g = x.view(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(shape).to(dtype)
