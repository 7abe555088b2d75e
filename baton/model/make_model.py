"""Write a seeded random checkpoint of any registered family (`baton make-model`, the named
test models, tests and benchmarks): the family's maker (`FamilySpec.make`) writes
config.json, model.safetensors and tokenizer_config.json; `tokenizer` adds a Hugging Face
tokenizer.json (byte-level BPE trained on the shipped text, `tokenizer_build.py`), else text
is the byte-level fallback."""

from __future__ import annotations

import json
from pathlib import Path

from baton.model import family as families
from baton.model.tokenizer_build import write_tokenizer


def write_checkpoint(out_dir: str | Path, *, preset: str = "tiny", seed: int = 0,
                     family: str | None = None, tokenizer: bool = False, **fields) -> Path:
    """`family` None: the default family. `fields` override config.json entries (the
    family's names, plus `pattern`). Returns `out_dir`."""
    spec = families.for_model_type(None) if family is None else _spec(family)
    out = spec.write_checkpoint(out_dir, preset=preset, seed=seed, **fields)
    if tokenizer:  # same special ids (0, 1, 2); the family's chat template is kept
        cfg = json.loads((Path(out) / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        write_tokenizer(out, text["vocab_size"], text.get("max_position_embeddings", 131072))
    return Path(out)


def _spec(family: str):
    if family not in families.names():
        raise ValueError(f"family={family!r}: make-model writes one of {families.names()}")
    return families.by_name(family)
