"""The engine says which decode-end snapshot a finished request left, and the cache manager
answers how much of a prompt it would restore (what a decode worker's Serve checks)."""

from __future__ import annotations

import pytest

from baton.engine.request import Request
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

SNAP = {"additional_snapshot_offsets_from_end": [0], "decode_end_snapshot": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hint"))


def test_last_output_names_the_decode_end_snapshot(model):
    eng = engine_for(model, cache={"mamba_state_config": SNAP})
    first = prompt(1, 48)  # block-aligned: its prompt-end snapshot is not replaced by the
    out = run_all(eng, [Request("a", first, greedy(6))])  # decode end's partial one
    last = out["outputs"]["a"]
    assert last.snapshot_tokens == 48 + 6
    history = first + out["tokens"]["a"]
    assert eng.cache.cached_prefix(history + prompt(2, 5)) == 54
    assert eng.cache.cached_prefix(first + [7]) == 48  # the prompt-end snapshot
    assert eng.cache.cached_prefix(prompt(3, 40)) == 0
    nxt = run_all(eng, [Request("b", history + prompt(2, 5), greedy(2))])
    assert nxt["outputs"]["b"].cached_tokens == 54
    eng.cache.check_integrity()


def test_no_decode_end_snapshot_no_hint(model):
    eng = engine_for(model, cache={"mamba_state_config": {**SNAP, "decode_end_snapshot": False}})
    out = run_all(eng, [Request("a", prompt(1, 37), greedy(6))])
    assert out["outputs"]["a"].snapshot_tokens == 0
