"""fp8 KV (issue 50) under pipeline and tensor parallelism: each PP stage stores its own
attention layers' rows and scales, each TP rank its KV heads' rows with their scales (an fp8
row is [head_dim values | scale]); both give the colocated fp8 engine's greedy tokens."""

from __future__ import annotations

import pytest

from baton.engine.request import Request
from baton.model.loader import load_model
from tests.integration.test_tp_engine import MARGIN, greedy_margins
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

pytestmark = pytest.mark.integration

WORKER = {"prefill_chunk_size": 32, "max_batch_tokens": 96}
CACHE = {"kv_dtype": "float8_e4m3"}
LENGTHS = [1, 5, 17, 40, 95]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("kv-par"), pattern="MMM*-M*-")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    mp = pytest.MonkeyPatch()
    mp.setenv("BATON_NUM_THREADS", "1")  # one torch thread per process on 2 cores
    yield
    mp.undo()


def _tokens(model_dir, lengths, **worker):
    eng = engine_for(model_dir, worker={**WORKER, **worker}, cache=CACHE)
    try:
        assert eng.pools.spec.kv_store_dtype.itemsize == 1
        reqs = [Request(f"r{i}", prompt(i, n), greedy(10)) for i, n in enumerate(lengths)]
        return run_all(eng, reqs)["tokens"]
    finally:
        if hasattr(eng.model, "close"):
            eng.model.close()


def test_pp2_equals_colocated_with_fp8_kv(model_dir):
    assert _tokens(model_dir, LENGTHS, pipeline_parallel_size=2,
                   pp_layer_partition=[4, 4]) == _tokens(model_dir, LENGTHS)


def test_tp2_equals_tp1_with_fp8_kv(model_dir):
    ref = load_model(model_dir)  # prompts whose float32 greedy margins leave no near-tie
    kept = [n for i, n in enumerate(LENGTHS)
            if min(m for _, _, m in greedy_margins(ref, prompt(i, n), 10)[1]) >= MARGIN]
    assert len(kept) >= 3
    lengths = [n if n in kept else 0 for n in LENGTHS]
    want = {k: v for k, v in _tokens(model_dir, [n or 1 for n in lengths]).items()
            if lengths[int(k[1:])]}
    got = _tokens(model_dir, [n or 1 for n in lengths], tensor_parallel_size=2)
    assert {k: got[k] for k in want} == want
