"""Resolve a model name or path to a checkpoint directory, generating named test models once."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from baton.errors import ConfigError

# name -> (cache folder, write_checkpoint kwargs). Bump the folder's version when the recipe
# changes so stale caches are never reused.
NAMED = {
    "tiny": ("tiny-v3", {"preset": "tiny", "seed": 0, "tokenizer": True}),
    "100m": ("100m-v3", {"preset": "100m", "seed": 0, "tokenizer": True}),
    "qwen3_5-tiny": ("qwen3_5-tiny-v2", {"family": "qwen3_5", "preset": "tiny", "seed": 0,
                                         "tokenizer": True}),
}


def cache_dir() -> Path:
    return Path(os.environ.get("BATON_CACHE_DIR") or Path.home() / ".cache" / "baton")


def resolve_model(name_or_path: str | Path) -> Path:
    """A named model (`tiny`, `100m`, `qwen3_5-tiny`) generated into the cache on first use, else a directory."""
    key = str(name_or_path)
    if key in NAMED:
        folder, kwargs = NAMED[key]
        return _ensure_generated(cache_dir() / folder, kwargs)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model {key!r} is neither a named model {sorted(NAMED)} nor an existing "
            f"directory with config.json and *.safetensors"
        )
    return path


def served_name(model_dir: str | Path) -> str:
    """The name clients use for a checkpoint: `tiny` for the named model, else the folder name."""
    path = Path(model_dir)
    for name, (folder, _) in NAMED.items():
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
