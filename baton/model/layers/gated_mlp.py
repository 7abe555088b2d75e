"""The SwiGLU MLP of Qwen-style layers: `down(silu(gate(x)) * up(x))`; on the fast decode
path gate and up are one kernel call (`linear.fused_linears`), whose column views also keep
silu's rounding per row (a contiguous [rows, width] would leave a size-dependent tail to
torch's scalar loop)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.layers import linear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = linear.fused_linears(x, self.gate_proj, self.up_proj)  # fast decode path
        gate, up = both if both is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)
