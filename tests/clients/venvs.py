"""The clients' own virtualenvs, cached under ~/.cache/baton/venvs/ (never the project's .venv).

Each is made once per pinned version: `python -m venv`, then pip from the package index as
this machine is set up (torch first and pinned, so pip takes the CPU build from this machine's
disk, as the project's Makefile does), then a stamp file; a half-made one (no stamp) is made
again from scratch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

LM_EVAL = "0.4.13"
AIPERF = "0.13.0"
OPENAI_AGENTS = "0.24.0"
TORCH = "torch==2.13.0"


def _test_pin(name: str) -> str:
    """The project's own pin of `name` in pyproject.toml's `test` extra."""
    import tomllib

    with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["test"]
    return next(d for d in extra if d.startswith(f"{name}=="))


TRANSFORMERS = _test_pin("transformers")
"""lm-eval's `hf` model is the oracle Baton is compared with: the same transformers as the
project's tests (pinned in pyproject.toml: releases change models' numerics)."""
SPECS = {
    f"lm-eval-{LM_EVAL}": [[TORCH], [f"lm-eval[hf,api]=={LM_EVAL}", TRANSFORMERS]],
    f"aiperf-{AIPERF}": [[TORCH], [f"aiperf=={AIPERF}"]],
    f"openai-agents-{OPENAI_AGENTS}": [[f"openai-agents=={OPENAI_AGENTS}"]],
}


def root() -> Path:
    base = os.environ.get("BATON_CACHE_DIR") or Path.home() / ".cache" / "baton"
    return Path(base) / "venvs"


def ensure(name: str) -> Path:
    """The venv's bin folder, made if missing."""
    venv = root() / name
    stamp = venv / ".baton-installed"
    want = "\n".join(" ".join(g) for g in SPECS[name]) + "\n"
    if stamp.is_file() and stamp.read_text() == want:
        return venv / "bin"
    if not (venv / "bin" / "python").is_file():  # else pip adds what a changed spec lacks
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        python = getattr(sys, "_base_executable", None) or shutil.which("python3")
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    print(f"test-clients: installing into {venv} (once)", flush=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    log = venv / "pip.log"
    for group in SPECS[name]:
        with open(log, "a") as f:
            rc = subprocess.run([*pip, *group], stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            tail = "\n".join(log.read_text().splitlines()[-10:])
            raise RuntimeError(f"pip install {' '.join(group)} into {venv} failed ({rc}):\n{tail}")
    stamp.write_text(want)
    return venv / "bin"


def version(bin_dir: Path, dist: str) -> str:
    out = subprocess.run([str(bin_dir / "python"), "-c",
                          f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()
