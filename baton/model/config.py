"""Model configs by family: `load_config` reads a checkpoint's `config.json` into the
family's frozen dataclass, chosen by its `model_type`.

Every family's config answers the same questions the cache, transfer and engine ask
(`num_layers`, `pattern`, `attention_layers`, `state_layers`, `state_tensors`, KV heads and
head size, vocabulary, special tokens); see `baton.model.state_spec`.
"""

from __future__ import annotations

import json
from pathlib import Path

from baton.errors import ConfigError
from baton.model.nemotron_h.config import ModelConfig

__all__ = ["ModelConfig", "config_from_dict", "load_config", "FAMILIES"]

FAMILIES: dict[str, type] = {"nemotron_h": ModelConfig}
"""model_type -> config class. A family registers itself here on import."""


def config_from_dict(d: dict):
    """The config of the family `d["model_type"]` names (NemotronH when absent)."""
    _import_families()
    kind = d.get("model_type") or "nemotron_h"
    cls = FAMILIES.get(kind)
    if cls is None:
        raise ConfigError(
            f"model_type {kind!r} is not served by Baton; served families: {sorted(FAMILIES)}"
        )
    return cls.from_dict(d)


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


def _import_families() -> None:
    """Families beyond NemotronH register on import (kept lazy: each pulls its own modules)."""
    for mod in ("baton.model.qwen3_5.config", "baton.model.qwen3_5.moe_config"):
        try:
            __import__(mod)
        except ModuleNotFoundError as e:
            if not mod.startswith(str(e.name)):
                raise
