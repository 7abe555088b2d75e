"""Qwen3.5 model config: reads a `qwen3_5` (multimodal, `text_config`) or `qwen3_5_text`
`config.json` into a frozen dataclass (both model types: `family.py`).

Layer kinds (`pattern`, one char per layer): `G` = gated DeltaNet ("linear_attention"),
`*` = gated full attention ("full_attention"). Every layer also has a SwiGLU MLP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from baton.errors import ConfigError
from baton.model import flops
from baton.model.config import LayerPattern
from baton.model.state_spec import StateTensorSpec

LAYER_TYPE_TO_CHAR = {"linear_attention": "G", "full_attention": "*"}
STATE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Qwen35Config(LayerPattern):
    vocab_size: int
    hidden_size: int
    pattern: str
    """One char per layer: G = gated DeltaNet, * = gated attention."""
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    intermediate_size: int = 12288
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    """q/k/v/o projections of the attention layers carry a bias (transformers honours it)."""
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    state_dtype: str = "float32"
    """dtype of the DeltaNet recurrent state (the checkpoint's `mamba_ssm_dtype`)."""
    multimodal: bool = False
    """The checkpoint is the published `qwen3_5` layout: text weights under
    `model.language_model.`, a vision tower Baton skips."""
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    chunk_size: int = 64
    """The chunked DeltaNet scan's chunk (transformers' fixed 64)."""
    family: str = "qwen3_5"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.pattern:
            raise ConfigError("num_hidden_layers: the model has no layers (got 0)")
        _divides("num_attention_heads", self.num_attention_heads,
                 "num_key_value_heads", self.num_key_value_heads)
        _divides("linear_num_value_heads", self.linear_num_value_heads,
                 "linear_num_key_heads", self.linear_num_key_heads)
        if self.linear_conv_kernel_dim < 2:
            raise ConfigError(
                f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be at least 2"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(
                f"partial_rotary_factor={self.partial_rotary_factor} must give an even rotary "
                f"width in (0, head_dim={self.head_dim}]"
            )
        if self.state_dtype not in STATE_DTYPES:
            raise ConfigError(
                f"mamba_ssm_dtype={self.state_dtype!r} is not supported: use one of "
                f"{list(STATE_DTYPES)}"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported: use 'silu'")

    # ---- what every family's config answers (see baton.model.state_spec) --------------------
    STATE_CHARS = "G"
    """Layers with recurrent state: the gated DeltaNet (`G`) layers."""

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_sections(self) -> tuple[int, int, int]:
        """Channel counts of the conv state's `[q | k | v]` sections."""
        return (self.key_dim, self.key_dim, self.value_dim)

    @property
    def conv_dim(self) -> int:
        return sum(self.conv_sections)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @cached_property
    def state_tensors(self) -> tuple[StateTensorSpec, ...]:
        """One DeltaNet slot: the conv window [q | k | v] and the recurrent matrix, by value
        heads (transformers' [HV, dk, dv] order), in the checkpoint's `mamba_ssm_dtype`."""
        return (
            StateTensorSpec("conv", (self.conv_dim, self.linear_conv_kernel_dim - 1),
                            sections=self.conv_sections, section_names=("q", "k", "v"),
                            section_units=(self.linear_num_key_heads, self.linear_num_key_heads,
                                           self.linear_num_value_heads)),
            StateTensorSpec("recurrent", (self.linear_num_value_heads, self.linear_key_head_dim,
                                          self.linear_value_head_dim),
                            dtype=self.state_dtype, sections=(self.linear_num_value_heads,),
                            section_names=("value_heads",),
                            section_units=(self.linear_num_value_heads,)),
        )

    def prefill_flops(self) -> tuple[int, int]:
        """(FLOPs per prompt token, attention's position coefficient): `baton.model.flops`
        over the layers, each a mixer and its SwiGLU MLP (MoE: its top-k experts)."""
        d, lin, quad = self.hidden_size, 0, 0
        for c in self.pattern:
            if c == "G":
                lin += flops.gated_deltanet(d, self.linear_num_key_heads,
                                            self.linear_key_head_dim,
                                            self.linear_num_value_heads,
                                            self.linear_value_head_dim)
            elif c == "*":
                a, q = flops.attention(d, self.num_attention_heads, self.num_key_value_heads,
                                       self.head_dim)
                lin, quad = lin + a, quad + q
            lin += self.feed_forward_flops()
        return lin, quad

    def feed_forward_flops(self) -> int:
        """A layer's feed-forward, per token (here the SwiGLU MLP)."""
        return flops.mlp(self.hidden_size, self.intermediate_size, gated=True)

    def tp_rules(self) -> list[tuple[str, int, str]]:
        """DeltaNet: value heads split, key heads split or replicated; the dense MLP (where a
        layer has one) by its width (beyond vocab, hidden and attention heads: tp_shard)."""
        rules = []
        if len(getattr(self, "moe_layers", ())) < self.num_layers:
            rules += [("intermediate_size", self.intermediate_size, "split")]
        if "G" in self.pattern:
            rules += [("linear_num_value_heads", self.linear_num_value_heads, "split"),
                      ("linear_num_key_heads", self.linear_num_key_heads, "split_or_replicate")]
        return rules

    def tp_layout(self) -> list[tuple[str, int]]:
        """(label, units) of what a TP rank holds beyond vocab and attention heads."""
        if "G" not in self.pattern:
            return []
        return [("key heads", self.linear_num_key_heads),
                ("value heads", self.linear_num_value_heads)]

    @classmethod
    def from_dict(cls, d: dict) -> Qwen35Config:
        multimodal = d.get("model_type") == "qwen3_5"
        text = d.get("text_config") if multimodal else d
        if not isinstance(text, dict):
            raise ConfigError("text_config: a qwen3_5 config.json needs a text_config object")
        return _from_text(text, multimodal, d)


def _from_text(t: dict, multimodal: bool, top: dict) -> Qwen35Config:
    def pick(name, default=None):
        v = t.get(name)
        return default if v is None else v

    n_layers = int(_require(t, "num_hidden_layers"))
    rope = dict(t.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ConfigError(
            f"rope_parameters.rope_type={rope_type!r} is not supported: Baton serves 'default'"
        )
    eos = pick("eos_token_id", top.get("eos_token_id"))
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    n_heads = int(pick("num_attention_heads", 16))
    tie = pick("tie_word_embeddings", top.get("tie_word_embeddings", False))
    return Qwen35Config(
        vocab_size=int(_require(t, "vocab_size")),
        hidden_size=int(_require(t, "hidden_size")),
        pattern=_pattern(t, n_layers),
        num_attention_heads=n_heads,
        num_key_value_heads=int(pick("num_key_value_heads", n_heads)),
        head_dim=int(pick("head_dim", 256)),
        intermediate_size=int(pick("intermediate_size", 12288)),
        linear_num_key_heads=int(pick("linear_num_key_heads", 16)),
        linear_num_value_heads=int(pick("linear_num_value_heads", 32)),
        linear_key_head_dim=int(pick("linear_key_head_dim", 128)),
        linear_value_head_dim=int(pick("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(pick("linear_conv_kernel_dim", 4)),
        rms_norm_eps=float(pick("rms_norm_eps", 1e-6)),
        attention_bias=bool(pick("attention_bias", False)),
        hidden_act=str(pick("hidden_act", "silu")),
        rope_theta=float(rope.get("rope_theta", pick("rope_theta", 10000.0))),
        partial_rotary_factor=float(
            rope.get("partial_rotary_factor", pick("partial_rotary_factor", 0.25))
        ),
        max_position_embeddings=int(pick("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(tie),
        state_dtype=str(pick("mamba_ssm_dtype", top.get("mamba_ssm_dtype", "float32"))),
        multimodal=multimodal,
        eos_token_id=eos_ids,
        bos_token_id=pick("bos_token_id", top.get("bos_token_id")),
        pad_token_id=pick("pad_token_id", top.get("pad_token_id")),
        raw=dict(top),
    )


def _pattern(t: dict, n_layers: int) -> str:
    types = t.get("layer_types")
    if types is None:
        interval = int(t.get("full_attention_interval") or 4)
        if interval < 1:
            raise ConfigError(f"full_attention_interval={interval} must be at least 1")
        return "".join("*" if (i + 1) % interval == 0 else "G" for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers:
        got = len(types) if isinstance(types, list) else type(types).__name__
        raise ConfigError(
            f"layer_types has {got} entries but num_hidden_layers={n_layers}: give one per layer"
        )
    unknown = sorted({str(x) for x in types if x not in LAYER_TYPE_TO_CHAR})
    if unknown:
        raise ConfigError(
            f"layer_types: unknown layer kind(s) {unknown}: expected one of "
            f"{sorted(LAYER_TYPE_TO_CHAR)}"
        )
    return "".join(LAYER_TYPE_TO_CHAR[x] for x in types)


def _divides(name: str, value: int, by_name: str, by: int) -> None:
    if by < 1 or value % by:
        raise ConfigError(f"{name}={value} is not a multiple of {by_name}={by}")


def _require(d: dict, key: str):
    if key not in d:
        raise ConfigError(f"config.json is missing required field {key!r}")
    return d[key]

