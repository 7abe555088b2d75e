"""The trained named models (`code-nemotron_h`, `code-qwen3_5`) for tests: their committed
folders, or a skip saying how to make them while this checkout has none (BATON_TRAINED_DIR
points the names at other folders, e.g. a short probe run shipped with baton.train.ship)."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.errors import ConfigError
from baton.model.registry import TRAINED, resolve_model

NAMES = sorted(TRAINED)


def shipped(name: str) -> Path:
    """The folder `name` resolves to; skips the test when the model is not shipped."""
    try:
        return resolve_model(name)
    except ConfigError:
        pytest.skip(f"{name} is not shipped in this checkout: `make train-models` (about 2 "
                    f"hours), then `make ship-models`")


def heldout_prompts(tok, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` token ids from the committed held-out text, one file each."""
    from baton.train.corpus import heldout

    docs = heldout()
    out = []
    for i in range(n):
        ids = tok.encode(docs[i % len(docs)].text)
        start = (len(ids) // (n + 1)) * (i // len(docs) + 1)
        out.append(ids[start : start + length])
    return out
