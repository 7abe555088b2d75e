"""`make ship-models`: the finished `make train-models` runs become the named models.

    python -m baton.train.ship [--runs runs] [--dest baton/models_data] [NAME ...]

For each trained named model (`baton.model.registry.TRAINED`) it copies runs/<name>/'s
checkpoint into <dest>/<name>/, minus the run's own state (.train/): config.json,
model.safetensors, tokenizer.json, training.json, and tokenizer_config.json with the
family's published chat template (tool calls included, docs/agents.md). It refuses, in one
line, a run that has not finished, weights that are not all bfloat16, or a pair over 25 MB;
nothing is written then.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from baton.errors import ConfigError
from baton.model import family as families
from baton.model.registry import TRAINED, trained_dir

FILES = ("config.json", "model.safetensors", "tokenizer.json", "training.json")
MAX_BYTES = 25 * 1000 * 1000
"""The shipped checkpoints together, tokenizers included (the issue's 25 MB)."""


def check_run(run: Path) -> int:
    """The bytes the shipped copy of `run` takes; ConfigError when it cannot ship."""
    if not (run / "training.json").is_file():
        raise ConfigError(f"{run} is not a finished `baton train` run (no training.json): "
                          f"run `make train-models` to the end first")
    for name in FILES + ("tokenizer_config.json",):
        if not (run / name).is_file():
            raise ConfigError(f"{run} has no {name}")
    not_bf16 = _not_bf16(run / "model.safetensors")
    if not_bf16:
        raise ConfigError(f"{run}/model.safetensors: tensor {not_bf16[0]!r} is {not_bf16[1]}, "
                          f"the shipped weights are bfloat16 (train with --dtype bfloat16)")
    return sum((run / n).stat().st_size for n in FILES) + len(_tokenizer_config(run))


def ship(runs: Path, dest: Path, names: list[str]) -> list[Path]:
    """Copy the finished runs of `names` into dest/<name>/ (replacing what is there)."""
    for name in names:
        if name not in TRAINED:
            raise ConfigError(f"model {name!r} is not a trained named model: {sorted(TRAINED)}")
    sizes = {name: check_run(runs / name) for name in names}
    others = sum(_shipped_bytes(dest / n) for n in TRAINED if n not in names)
    total = sum(sizes.values()) + others
    if total > MAX_BYTES:
        raise ConfigError(f"the shipped models would take {total / 1e6:.1f} MB, over "
                          f"{MAX_BYTES / 1e6:.0f} MB: train smaller sizes")
    out = []
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        run, target = runs / name, dest / name
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest))
        tmp.chmod(0o755)
        try:
            for f in FILES:
                shutil.copyfile(run / f, tmp / f)
            (tmp / "tokenizer_config.json").write_text(_tokenizer_config(run))
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        out.append(target)
    return out


def _tokenizer_config(run: Path) -> str:
    cfg = json.loads((run / "tokenizer_config.json").read_text())
    family = json.loads((run / "training.json").read_text())["settings"]["family"]
    cfg["chat_template"] = families.by_name(family).chat_template_text()
    return json.dumps(cfg, indent=2) + "\n"


def _not_bf16(path: Path) -> tuple[str, str] | None:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            dtype = f.get_slice(k).get_dtype()
            if dtype != "BF16":
                return k, dtype
    return None


def _shipped_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) \
        if folder.is_dir() else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m baton.train.ship", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", default=sorted(TRAINED), help="models to ship")
    ap.add_argument("--runs", default="runs", help="folder holding the runs, one per name")
    ap.add_argument("--dest", default=None, help="default: baton/models_data")
    args = ap.parse_args(argv)
    dest = Path(args.dest) if args.dest else trained_dir()
    try:
        done = ship(Path(args.runs), dest, args.names)
    except ConfigError as e:
        print(f"ship-models: error: {e}", file=sys.stderr)
        return 2
    total = sum(_shipped_bytes(dest / n) for n in TRAINED)
    for path in done:
        ev = json.loads((path / "training.json").read_text())["heldout"]
        print(f"shipped {path}: {_shipped_bytes(path) / 1e6:.1f} MB, held-out "
              f"{ev['loss']:.3f} nats/token, {ev['bits_per_byte']:.3f} bits/byte")
    print(f"the shipped models take {total / 1e6:.1f} MB together (at most "
          f"{MAX_BYTES / 1e6:.0f}); commit {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
