"""NemotronH model config: reads HF `config.json` field names into a frozen dataclass."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from baton.errors import ConfigError
from baton.model import flops
from baton.model.config import LayerPattern
from baton.model.state_spec import StateTensorSpec

# transformers 5 writes `layers_block_type`; published checkpoints use the pattern string.
BLOCK_TYPE_TO_CHAR = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
SUPPORTED_CHARS = "M*-E"


@dataclass(frozen=True)
class ModelConfig(LayerPattern):
    vocab_size: int
    hidden_size: int
    pattern: str
    """One char per layer: M = Mamba2, * = attention, - = MLP, E = mixture of experts."""
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 21504
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False
    mamba_proj_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    time_step_min: float = 0.001
    """HF's mixer clamps dt from below at this (not time_step_limit[0]); see `dt_limit`."""
    mlp_hidden_act: str = "relu2"
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    residual_in_fp32: bool = False
    n_routed_experts: int = 8
    """Routed experts per `E` layer (defaults here and below are transformers')."""
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    """Width of the one shared expert, which runs on every token's (non-latent) input."""
    moe_latent_size: int | None = None
    """Set: routed experts work in this latent width between fc1/fc2_latent_proj."""
    n_group: int = 1
    """Experts are split into n_group groups; only the best topk_group groups are eligible."""
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    eos_token_id: tuple[int, ...] = (2,)
    bos_token_id: int | None = 1
    pad_token_id: int | None = 0
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    """The config.json as read, for fields Baton does not model."""

    def __post_init__(self) -> None:
        bad = sorted({c for c in self.pattern if c not in SUPPORTED_CHARS})
        if bad:
            raise ConfigError(
                f"unsupported layer kind(s) {bad} in pattern {self.pattern!r}: "
                f"Baton supports {list(SUPPORTED_CHARS)} (M=Mamba2, *=attention, -=MLP, E=MoE)"
            )
        if not self.pattern:
            raise ConfigError("the model has no layers: pattern is empty")
        if "*" in self.pattern and self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if "M" in self.pattern and self.mamba_num_heads % self.n_groups:
            raise ConfigError(
                f"mamba_num_heads={self.mamba_num_heads} is not a multiple of n_groups={self.n_groups}"
            )
        if "E" in self.pattern:
            _check_moe(self)

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return self.state_layers

    @cached_property
    def moe_layers(self) -> tuple[int, ...]:
        """Global ids of the `E` layers: they hold weights only, no KV and no state."""
        return tuple(i for i, c in enumerate(self.pattern) if c == "E")

    family = "nemotron_h"
    STATE_CHARS = "M"
    """Layers with recurrent state: the Mamba2 (`M`) layers."""

    @cached_property
    def state_tensors(self) -> tuple[StateTensorSpec, ...]:
        """One Mamba2 slot: the conv window [x | B | C] and the SSM state, by heads."""
        return (
            StateTensorSpec("conv", (self.conv_dim, self.conv_kernel - 1),
                            sections=self.conv_sections, section_names=("x", "B", "C"),
                            section_units=(self.mamba_num_heads, self.n_groups, self.n_groups)),
            StateTensorSpec("ssm", (self.mamba_num_heads, self.mamba_head_dim,
                                    self.ssm_state_size),
                            sections=(self.mamba_num_heads,), section_names=("heads",),
                            section_units=(self.mamba_num_heads,)),
        )

    def prefill_flops(self) -> tuple[int, int]:
        """(FLOPs per prompt token, attention's position coefficient): `baton.model.flops`
        over the layers (relu2 MLPs: two matrices)."""
        d, lin, quad = self.hidden_size, 0, 0
        for c in self.pattern:
            if c == "M":
                lin += flops.mamba2(d, self.mamba_num_heads, self.mamba_head_dim, self.n_groups,
                                    self.ssm_state_size, self.conv_kernel)
            elif c == "*":
                a, q = flops.attention(d, self.num_attention_heads, self.num_key_value_heads,
                                       self.head_dim)
                lin, quad = lin + a, quad + q
            elif c == "-":
                lin += flops.mlp(d, self.intermediate_size, gated=False)
            elif c == "E":
                lin += flops.moe(d, self.n_routed_experts, self.num_experts_per_tok,
                                 self.moe_intermediate_size,
                                 self.moe_shared_expert_intermediate_size)
        return lin, quad

    def tp_rules(self) -> list[tuple[str, int, str]]:
        """What the TP size must meet beyond vocab, hidden and attention heads (tp_shard)."""
        rules = []
        if "M" in self.pattern:
            rules += [("mamba_num_heads", self.mamba_num_heads, "split"),
                      ("n_groups", self.n_groups, "split_or_one")]
        if "-" in self.pattern:
            rules.append(("intermediate_size", self.intermediate_size, "split"))
        return rules

    def tp_layout(self) -> list[tuple[str, int]]:
        """(label, units) of what a TP rank holds beyond vocab and attention heads."""
        if "M" not in self.pattern:
            return []
        return [("mamba heads", self.mamba_num_heads), ("groups", self.n_groups)]

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_sections(self) -> tuple[int, int, int]:
        """Channel counts of the conv state's `[x | B | C]` sections."""
        gs = self.n_groups * self.ssm_state_size
        return (self.mamba_intermediate, gs, gs)

    @property
    def conv_dim(self) -> int:
        return sum(self.conv_sections)

    @property
    def dt_limit(self) -> tuple[float, float]:
        """Clamp range for the softplus'd Mamba time step.

        transformers' NemotronH mixer uses `(time_step_min, inf)`, ignoring the lower bound of
        `time_step_limit`; we follow it (it is the test oracle) but keep any finite upper bound.
        """
        lo, hi = self.time_step_limit
        return (max(lo, self.time_step_min), hi)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        pattern = _pattern_of(d)

        def pick(*names, default=None):
            for n in names:
                if n in d and d[n] is not None:
                    return d[n]
            return default

        eos = pick("eos_token_id", default=2)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        n_heads = int(pick("num_attention_heads", default=32))
        hidden = int(_require(d, "hidden_size"))
        return cls(
            vocab_size=int(_require(d, "vocab_size")),
            hidden_size=hidden,
            pattern=pattern,
            num_attention_heads=n_heads,
            num_key_value_heads=int(pick("num_key_value_heads", default=n_heads)),
            head_dim=int(pick("head_dim", "attention_head_dim", default=hidden // n_heads)),
            intermediate_size=int(pick("intermediate_size", default=21504)),
            mamba_num_heads=int(pick("mamba_num_heads", default=128)),
            mamba_head_dim=int(pick("mamba_head_dim", default=64)),
            ssm_state_size=int(pick("ssm_state_size", default=128)),
            n_groups=int(pick("n_groups", "mamba_n_groups", default=8)),
            conv_kernel=int(pick("conv_kernel", "mamba_d_conv", default=4)),
            chunk_size=int(pick("chunk_size", "mamba_chunk_size", default=128)),
            use_conv_bias=bool(pick("use_conv_bias", "mamba_conv_bias", default=True)),
            use_bias=bool(pick("use_bias", default=False)),
            mamba_proj_bias=bool(pick("mamba_proj_bias", default=False)),
            attention_bias=bool(pick("attention_bias", default=False)),
            mlp_bias=bool(pick("mlp_bias", default=False)),
            layer_norm_epsilon=float(pick("layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
            time_step_limit=tuple(
                _as_float(x) for x in pick("time_step_limit", default=(0.0, float("inf")))
            ),
            time_step_min=_as_float(pick("time_step_min", "mamba_dt_min", default=0.001)),
            mlp_hidden_act=str(pick("mlp_hidden_act", default="relu2")),
            max_position_embeddings=int(pick("max_position_embeddings", default=4096)),
            tie_word_embeddings=bool(pick("tie_word_embeddings", default=False)),
            residual_in_fp32=bool(pick("residual_in_fp32", default=False)),
            **_moe_fields(d, pick),
            eos_token_id=eos_ids,
            bos_token_id=pick("bos_token_id"),
            pad_token_id=pick("pad_token_id"),
            raw=dict(d),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"no config.json in model directory {str(path)!r}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from e
        return cls.from_dict(d)


def _moe_fields(d: dict, pick) -> dict:
    latent = pick("moe_latent_size")
    return dict(
        n_routed_experts=int(pick("n_routed_experts", "num_local_experts", default=8)),
        num_experts_per_tok=int(pick("num_experts_per_tok", default=2)),
        moe_intermediate_size=int(pick("moe_intermediate_size", default=7688)),
        moe_shared_expert_intermediate_size=int(
            pick("moe_shared_expert_intermediate_size", default=7688)
        ),
        moe_latent_size=None if latent is None else int(latent),
        n_group=int(pick("n_group", default=1)),
        topk_group=int(pick("topk_group", default=1)),
        norm_topk_prob=bool(pick("norm_topk_prob", default=True)),
        routed_scaling_factor=float(pick("routed_scaling_factor", default=1.0)),
    )


def _check_moe(c: ModelConfig) -> None:
    """Router settings the `E` layers cannot run with; each error names the field and limit."""
    e, k = c.n_routed_experts, c.num_experts_per_tok
    if e < 1 or not 1 <= k <= e:
        raise ConfigError(
            f"num_experts_per_tok={k} must be between 1 and n_routed_experts={e}"
        )
    if c.n_group < 1 or e % c.n_group:
        raise ConfigError(
            f"n_routed_experts={e} cannot be split into n_group={c.n_group} equal groups: "
            f"make n_group a divisor of {e}"
        )
    if not 1 <= c.topk_group <= c.n_group:
        raise ConfigError(f"topk_group={c.topk_group} must be between 1 and n_group={c.n_group}")
    per_group = e // c.n_group
    if c.n_group > 1 and per_group < 2:
        raise ConfigError(
            f"n_group={c.n_group} leaves {per_group} expert per group; a group is scored by "
            f"its two best experts, so n_group must be at most {e // 2}"
        )
    if k > c.topk_group * per_group:
        raise ConfigError(
            f"num_experts_per_tok={k} is more than the {c.topk_group * per_group} experts of "
            f"the topk_group={c.topk_group} eligible groups"
        )
    if c.moe_latent_size is not None and c.moe_latent_size < 1:
        raise ConfigError(f"moe_latent_size={c.moe_latent_size} must be positive (or absent)")


def _as_float(x) -> float:
    # transformers writes non-finite floats in config.json as {"__float__": "Infinity"}.
    if isinstance(x, dict) and "__float__" in x:
        x = x["__float__"]
    return float(x)


def _require(d: dict, key: str):
    if key not in d:
        raise ConfigError(f"config.json is missing required field {key!r}")
    return d[key]


def _pattern_of(d: dict) -> str:
    if d.get("hybrid_override_pattern"):
        return str(d["hybrid_override_pattern"])
    types = d.get("layers_block_type") or d.get("layer_types")
    if types:
        unknown = [t for t in types if t not in BLOCK_TYPE_TO_CHAR]
        if unknown:
            raise ConfigError(
                f"unknown layers_block_type entries {unknown}: expected one of "
                f"{sorted(BLOCK_TYPE_TO_CHAR)}"
            )
        return "".join(BLOCK_TYPE_TO_CHAR[t] for t in types)
    raise ConfigError("config.json has neither 'hybrid_override_pattern' nor 'layers_block_type'")
