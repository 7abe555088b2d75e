"""A family that mixes two recurrent kinds in one model (`toy_mixed`, test-only): Mamba2 (`M`)
and gated DeltaNet (`G`) layers beside attention (`*`) and MLP (`-`), built from the shared
layers. Its config declares one state list for the model: Mamba2's `conv` and `ssm` and
DeltaNet's `gdn_conv` and `recurrent`, each layer kind reading its own names
(`protocol.RecurrentMixer.state_names`). Registered by importing this module (worker
processes: `BATON_FAMILY_MODULES`); nothing under baton/ names it."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from baton.errors import ConfigError
from baton.model.chat_template import tokenizer_config
from baton.model.family import FamilySpec, Weights, register
from baton.model.hybrid import HybridLM, HybridStage
from baton.model.layers.attention import Attention
from baton.model.layers.deltanet import GatedDeltaNet
from baton.model.layers.mamba2 import Mamba2Mixer
from baton.model.layers.mlp import MLP
from baton.model.layers.norms import RMSNorm
from baton.model.nemotron_h.config import ModelConfig
from baton.model.nemotron_h.make import _init, checkpoint_config
from baton.model.nemotron_h.model import NemotronHModel
from baton.model.nemotron_h.stage import StageModel
from baton.model.state_spec import StateTensorSpec

MODULE = __name__
"""What BATON_FAMILY_MODULES names for worker processes."""
GDN_STATE = ("gdn_conv", "recurrent")


@dataclass(frozen=True)
class DeltaNetDims:
    """What `GatedDeltaNet` reads (its own dimensions, not the Mamba2 layers')."""

    hidden_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    chunk_size: int = 64

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_sections(self) -> tuple[int, int, int]:
        k = self.linear_num_key_heads * self.linear_key_head_dim
        return (k, k, self.value_dim)

    @property
    def conv_dim(self) -> int:
        return sum(self.conv_sections)


@dataclass(frozen=True)
class ToyMixedConfig(ModelConfig):
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4

    family = "toy_mixed"
    STATE_CHARS = "MG"

    def __post_init__(self) -> None:
        bad = sorted({c for c in self.pattern if c not in "MG*-"})
        if bad:
            raise ConfigError(f"toy_mixed layers are 'M', 'G', '*' and '-', not {bad}")

    @classmethod
    def from_dict(cls, d: dict) -> ToyMixedConfig:
        pattern = d["hybrid_override_pattern"]
        base = ModelConfig.from_dict({**d, "hybrid_override_pattern": pattern.replace("G", "M")})
        own = {f.name: d[f.name] for f in fields(cls) if f.name.startswith("linear_") and f.name in d}
        return cls(**{**{k: getattr(base, k) for k in base.__dataclass_fields__},
                      "pattern": pattern, **own})

    @cached_property
    def deltanet(self) -> DeltaNetDims:
        return DeltaNetDims(self.hidden_size, self.linear_num_key_heads,
                            self.linear_num_value_heads, self.linear_key_head_dim,
                            self.linear_value_head_dim, self.linear_conv_kernel_dim,
                            self.layer_norm_epsilon)

    @cached_property
    def state_tensors(self) -> tuple[StateTensorSpec, ...]:
        """The model's one state list: the Mamba2 layers' tensors, then the DeltaNet ones'."""
        g = self.deltanet
        return (*ModelConfig.state_tensors.func(self),
                StateTensorSpec(GDN_STATE[0], (g.conv_dim, g.linear_conv_kernel_dim - 1),
                                sections=g.conv_sections),
                StateTensorSpec(GDN_STATE[1], (g.linear_num_value_heads, g.linear_key_head_dim,
                                               g.linear_value_head_dim), dtype="float32"))

    def tp_rules(self) -> list:
        return []

    def tp_layout(self) -> list:
        return []


def _mixer(cfg: ToyMixedConfig, i: int) -> nn.Module:
    kind = cfg.pattern[i]
    if kind == "G":
        return GatedDeltaNet(cfg.deltanet, i, state_names=GDN_STATE)
    return {"M": Mamba2Mixer, "*": Attention, "-": MLP}[kind](cfg, layer_idx=i)


class Block(nn.Module):
    """Pre-norm residual block around one mixer (NemotronH's, with `G` layers too)."""

    def __init__(self, cfg: ToyMixedConfig, layer_idx: int):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = _mixer(cfg, layer_idx)
        self.stateless = isinstance(self.mixer, MLP)

    def forward(self, h, ctx, decode: bool):
        x = self.norm(h)
        if self.stateless:
            return h + self.mixer(x)
        return h + (self.mixer.decode(x, ctx) if decode else self.mixer.prefill(x, ctx))

    def run_mixed(self, h, mix):
        x = self.norm(h)
        return h + (self.mixer(x) if self.stateless else mix(self.mixer, x))


class _Backbone(nn.Module):
    def __init__(self, cfg: ToyMixedConfig, layers):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in layers)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class ToyMixedModel(NemotronHModel):
    state_kind = "recurrent"

    def __init__(self, config: ToyMixedConfig):
        HybridLM.__init__(self)
        self.config = config
        self.mtp = None
        self.backbone = _Backbone(config, range(config.num_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class ToyMixedStage(StageModel):
    def __init__(self, config: ToyMixedConfig, layers: range, first: bool, last: bool):
        HybridStage.__init__(self, config, layers, first, last)
        self.backbone = nn.Module()
        self.backbone.layers = nn.ModuleDict({str(i): Block(config, i) for i in layers})
        if first:
            self.backbone.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if last:
            self.backbone.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def write_checkpoint(out_dir, *, preset: str = "tiny", seed: int = 0, **fields) -> Path:
    """A seeded toy_mixed checkpoint: NemotronH's preset and weight recipe, `G` layers
    beside the `M` ones."""
    pattern = fields.pop("pattern", "MG*-GM*-")
    d = checkpoint_config(preset, pattern=pattern.replace("G", "M"), **fields)
    d.update(model_type="toy_mixed", architectures=["ToyMixedForCausalLM"],
             hybrid_override_pattern=pattern)
    cfg = ToyMixedConfig.from_dict(d)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in ToyMixedModel(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _init(name, shape, cfg, gen) for name, shape in sorted(shapes.items())}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return out


SPEC = register(FamilySpec(
    name="toy_mixed",
    model_types=("toy_mixed",),
    config=f"{MODULE}:ToyMixedConfig",
    model=f"{MODULE}:ToyMixedModel",
    stage=f"{MODULE}:ToyMixedStage",
    weights=Weights(embeddings="backbone.embeddings.weight",
                    fp32_suffixes=(".A_log", ".D", ".dt_bias")),
    make=f"{MODULE}:write_checkpoint",
))
