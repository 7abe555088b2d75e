"""Model configs by family: `load_config` reads a checkpoint's `config.json` into the frozen
dataclass of the family its `model_type` names (`baton.model.family`).

Every family's config answers the same questions the cache, transfer and engine ask
(`num_layers`, `pattern`, `attention_layers`, `state_layers`, `state_tensors`, KV heads and
head size, vocabulary, special tokens); see `baton.model.state_spec`.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from baton.errors import ConfigError
from baton.model import family

__all__ = ["LayerPattern", "config_from_dict", "load_config"]


class LayerPattern:
    """What a config derives from its `pattern` (one char a layer): `num_layers`,
    `attention_layers` ('*') and `state_layers` (the chars in the family's `STATE_CHARS`);
    `moe_layers` (none unless the family declares them).
    A mixin of the family's frozen config dataclass."""

    STATE_CHARS = ""
    pattern: str

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    @cached_property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.pattern) if c == "*")

    @cached_property
    def state_layers(self) -> tuple[int, ...]:
        """Layers with recurrent state (a slot each)."""
        return tuple(i for i, c in enumerate(self.pattern) if c in self.STATE_CHARS)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers whose feed-forward is a mixture of experts (here none; a family with MoE
        layers declares them)."""
        return ()


def config_from_dict(d: dict):
    """The config of the family `d["model_type"]` names (the default family when absent)."""
    return family.for_model_type(d.get("model_type")).config_class().from_dict(d)


def load_config(path: str | Path):
    p = Path(path) / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json in model directory {str(path)!r}")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{p} must hold a JSON object")
    return config_from_dict(d)
