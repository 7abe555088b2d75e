"""Qwen-style norms: the zero-centred RMSNorm (weight stored as w, applied as 1 + w) and the
DeltaNet output's per-head gated RMSNorm (norm first, then x SiLU(gate))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.layers import fused, step_kernels


class ZeroCentredRMSNorm(nn.Module):
    """`norm(x) * (1 + w)` in float32, cast back once; a zero weight is the identity scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ((fused.fast_decoding(x) or fused.fast_prefill(x))
                and self.weight.dtype == torch.float32):
            k = step_kernels.kernels()
            out = None if k is None else k.rms_norm(x, self._scale(), self.eps)
            if out is not None:  # one call instead of eight ops (see step_kernels): a row alone
                return out
        f = x.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (f * (1.0 + self.weight.float())).to(x.dtype)

    def _scale(self) -> torch.Tensor:
        """1 + weight (the same float32 sum the reference computes each call), made once (again
        if the weight is replaced or changed in place)."""
        w = self.weight
        key = (w.data_ptr(), w._version)
        cached = getattr(self, "_baton_scale", None)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                object.__setattr__(self, "_baton_scale", (key, 1.0 + w.detach().float()))
            cached = self._baton_scale
        return cached[1]


class HeadGatedRMSNorm(nn.Module):
    """Per head of `head_dim` channels: `w * norm(x) * silu(gate)`, statistics in float32.

    The input is [..., heads * head_dim]; normalising per head keeps a head-sliced
    (tensor-parallel) shard exact.
    """

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.head_dim = head_dim
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        f = x.float().view(*shape[:-1], -1, self.head_dim)
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        # transformers: weight * normed (in the input dtype), then the fp32 gate, then one cast.
        f = self.weight * f.to(dtype)
        g = F.silu(gate.float()).view(*shape[:-1], -1, self.head_dim)
        return (f * g).to(dtype).view(shape)
