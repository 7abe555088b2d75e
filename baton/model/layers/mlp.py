"""The `-` layer of NemotronH: a two-matrix MLP with a squared-ReLU activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.errors import ConfigError
from baton.model.nemotron_h.config import ModelConfig


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


ACTIVATIONS = {"relu2": _relu2, "silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        if cfg.mlp_hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"mlp_hidden_act={cfg.mlp_hidden_act!r} is not supported: use one of "
                f"{sorted(ACTIVATIONS)}"
            )
        self.act = ACTIVATIONS[cfg.mlp_hidden_act]
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))
