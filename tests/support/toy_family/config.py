"""The toy family's config: NemotronH's fields, only attention and MLP layers (no state)."""

from __future__ import annotations

from dataclasses import dataclass

from baton.errors import ConfigError
from baton.model.nemotron_h.config import ModelConfig


@dataclass(frozen=True)
class ToyConfig(ModelConfig):
    family = "toy_dense"

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = sorted({c for c in self.pattern if c not in "*-"})
        if bad:
            raise ConfigError(f"toy_dense layers are '*' and '-', not {bad}")

    @classmethod
    def from_dict(cls, d: dict) -> ToyConfig:
        base = ModelConfig.from_dict(d)
        return cls(**{k: getattr(base, k) for k in base.__dataclass_fields__})
