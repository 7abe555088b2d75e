"""A two-matrix MLP with a squared-ReLU activation (NemotronH's `-` layers; also the shared
expert of the sigmoid-routed `MoE`, at its own width)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from baton.errors import ConfigError


class MLPDims(Protocol):
    """What the layer reads of a model config (any family's)."""

    hidden_size: int
    intermediate_size: int
    mlp_bias: bool
    mlp_hidden_act: str


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS = {"relu2": _relu2, "silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def activate(act, h: torch.Tensor) -> torch.Tensor:
    """act(h), where h is a matmul's own output nothing else reads: relu2 in place on it (the
    same ops and bits, without two more buffers as large as h: 16 MB each in a 2,048-token
    prefill of the bench model); never in place on a view or under autograd."""
    if act is _relu2 and h._base is None and not torch.is_grad_enabled():
        return torch.relu_(h).square_()
    return act(h)


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ConfigError(
            f"mlp_hidden_act={name!r} is not supported: use one of {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


class MLP(nn.Module):
    stateless = True

    def __init__(self, cfg: MLPDims, layer_idx: int = 0, intermediate_size: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.act = activation(cfg.mlp_hidden_act)
        width = intermediate_size or cfg.intermediate_size
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activate(self.act, self.up_proj(x)))
