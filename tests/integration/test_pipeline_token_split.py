"""A prefill forward with few long sequences is also split by tokens into micro-batches (at
scan-chunk boundaries), so pipeline stages overlap; the tokens stay the colocated engine's.
(Its own module: one process holds one default process group at a time.)"""

from __future__ import annotations

import pytest

from baton.engine.request import Request
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

PATTERN = "MMM*-M*-"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ppsplit"), pattern=PATTERN)


def _reqs(tag: str, lengths) -> list[Request]:
    return [Request(f"{tag}{i}", prompt(i, n), greedy(10)) for i, n in enumerate(lengths)]


LONG = [520, 300, 700, 1000]
LONG_WORKER = {"prefill_chunk_size": 512, "max_batch_tokens": 2048}
"""The first forward: 4 sequences x 512 tokens, on 3 stages 12 micro-batches are wanted, so
each sequence's chunk goes in 4 ranges of 128 tokens: 16 micro-batches (64 control sends
before the first hidden state; see test_pipeline_channel.py for the queue that must not
block on them)."""


def test_pipeline_token_split_micro_batches_equal_colocated(model_dir, monkeypatch):
    monkeypatch.setenv("BATON_NUM_THREADS", "1")
    want = run_all(engine_for(model_dir, worker=LONG_WORKER), _reqs("l", LONG))["tokens"]
    eng = engine_for(model_dir, worker={**LONG_WORKER, "pipeline_parallel_size": 3,
                                        "pp_layer_partition": [3, 3, 2]})
    try:
        plan = eng.model.plan(4, 512, 12, decode=False)
        assert len(plan) == 16 and plan[:2] == \
            [(range(0, 1), range(0, 128)), (range(1, 2), range(0, 128))]
        eng.model.token_split_forwards = 0
        assert run_all(eng, _reqs("l", LONG))["tokens"] == want
        assert eng.model.token_split_forwards >= 3
        eng.cache.check_integrity()
    finally:
        eng.model.close()
