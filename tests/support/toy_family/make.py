"""Seeded toy checkpoints: NemotronH's maker (its weights, names and tokenizer config) with
the toy `model_type` and a dense pattern."""

from __future__ import annotations

import json
from pathlib import Path

from baton.model.nemotron_h.make import write_checkpoint as write_nemotron_h


def write_checkpoint(out_dir, *, preset: str = "tiny", seed: int = 0, **fields) -> Path:
    fields.setdefault("pattern", "*-*-")
    out = Path(write_nemotron_h(out_dir, preset=preset, seed=seed, **fields))
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(model_type="toy_dense", architectures=["ToyDenseForCausalLM"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
