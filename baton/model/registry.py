"""Resolve a model name or path to a checkpoint directory, generating named test models once."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from baton import envs
from baton.errors import ConfigError
from baton.model import family


def named_models() -> dict[str, tuple[str, dict]]:
    """name -> (cache folder, write_checkpoint kwargs): every family's `named` models."""
    return {name: how for spec in family.specs() for name, how in spec.named.items()}


class _Trained(Mapping):
    """name -> family, read from the families' `TrainRecipe.shipped` on first use."""

    def _names(self) -> dict[str, str]:
        return {r.shipped: name for name, r in family.trained().items()}

    def __getitem__(self, name: str) -> str:
        return self._names()[name]

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


TRAINED: Mapping[str, str] = _Trained()
"""The models Baton trains itself (docs/training.md), name -> family: committed checkpoint
folders under `trained_dir()`, not generated."""


def trained_dir() -> Path:
    """Where the trained named models live: baton/models_data/<name>/ (BATON_TRAINED_DIR)."""
    return Path(envs.TRAINED_DIR.get() or Path(__file__).resolve().parents[1] / "models_data")


def cache_dir() -> Path:
    return Path(envs.CACHE_DIR.get() or Path.home() / ".cache" / "baton")


def resolve_model(name_or_path: str | Path) -> Path:
    """A named model (`named_models`, e.g. `tiny`) generated into the cache on first use, a
    trained one (`TRAINED`) from its committed folder, else a directory."""
    key = str(name_or_path)
    named = named_models()
    if key in named:
        folder, kwargs = named[key]
        return _ensure_generated(cache_dir() / folder, kwargs)
    if key in TRAINED:
        return trained_model(key)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model {key!r} is neither a named model {sorted(named) + sorted(TRAINED)} nor an "
            f"existing directory with config.json and *.safetensors"
        )
    return path


def trained_model(name: str) -> Path:
    """The committed checkpoint of a trained named model; ConfigError naming how to make it
    when this checkout does not have it."""
    path = trained_dir() / name
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model {name!r} is not shipped in this checkout ({path} holds no checkpoint): "
            f"train it with `make train-models` (about 2 hours), then `make ship-models` "
            f"copies it there")
    return path


def served_name(model_dir: str | Path) -> str:
    """The name clients use for a checkpoint: `tiny` for the named model, else the folder name."""
    path = Path(model_dir)
    for name, (folder, _) in named_models().items():
        if path == cache_dir() / folder:
            return name
    return path.name


def _ensure_generated(target: Path, kwargs: dict) -> Path:
    """Write into a private temp dir, then rename: racing processes never see a half model."""
    if target.is_dir():
        return target
    # imported here: `baton serve` resolves the model too, and torch (loaded by make_model)
    # costs it seconds at start and at exit
    from baton.model.make_model import write_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_checkpoint(tmp, **kwargs)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
