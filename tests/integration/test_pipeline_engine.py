"""A pipeline-parallel engine (real stage processes, one gloo group) gives exactly the
colocated engine's greedy tokens, with attention-free and state-free stages, chunked prefill,
micro-batches and prefix reuse; its cache manager stays consistent. For NemotronH and Qwen3.5."""

from __future__ import annotations

import pytest

from baton.engine.request import Request, SamplingParams
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

PATTERNS = {"nemotron_h": "MMM*-M*-", "qwen3_5": "GGG*G***"}
"""Split [3, 3, 2]: stage 0 attention-free, stage 2 free of recurrent state (Mamba/DeltaNet)."""
LENGTHS = [1, 5, 16, 17, 40, 95, 130]
WORKER = {"prefill_chunk_size": 32, "max_batch_tokens": 96}


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def model_dir(request, tmp_path_factory):
    family = request.param
    return make_checkpoint(tmp_path_factory.mktemp(f"pp-{family}"), pattern=PATTERNS[family],
                           family=family)


def _reqs(tag: str, lengths=LENGTHS, extra: dict | None = None) -> list[Request]:
    extra = extra or {}
    return [Request(f"{tag}{i}", prompt(i, n) + extra.get(i, []), greedy(10))
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def reference(model_dir):
    eng = engine_for(model_dir, worker=WORKER)
    first = run_all(eng, _reqs("a"))["tokens"]
    follow = _reqs("b", extra={i: first[f"a{i}"] + [7, 8, 9] for i in range(len(LENGTHS))})
    second = run_all(eng, follow)
    return first, second


@pytest.fixture(scope="module", params=[(3, [3, 3, 2])], ids=["pp3-332"])
def pp_engine(request, model_dir, monkeypatch_module):
    size, partition = request.param
    eng = engine_for(model_dir, worker={**WORKER, "pipeline_parallel_size": size,
                                        "pp_layer_partition": partition})
    yield eng
    procs = eng.model.local_stages.procs
    eng.model.close()
    assert all(p.poll() is not None for p in procs.values())


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.setenv("BATON_NUM_THREADS", "1")  # one torch thread per stage process on 2 cores
    yield mp
    mp.undo()


def test_pipeline_tokens_and_reuse_equal_colocated(pp_engine, reference):
    first, second = reference
    got = run_all(pp_engine, _reqs("a"))["tokens"]
    assert got == first
    follow = _reqs("b", extra={i: first[f"a{i}"] + [7, 8, 9] for i in range(len(LENGTHS))})
    res = run_all(pp_engine, follow)
    assert res["tokens"] == second["tokens"]
    cached = {k: o.cached_tokens for k, o in res["outputs"].items()}
    assert cached == {k: o.cached_tokens for k, o in second["outputs"].items()}
    assert sum(cached.values()) > 0
    pp_engine.cache.check_integrity()
    stats = pp_engine.cache.stats()
    assert stats.slots_live == 0 and stats.blocks_free + stats.blocks_cached == stats.blocks_total


def test_pipeline_stage_pools_hold_only_their_layers(pp_engine):
    model = pp_engine.model
    local, cfg = model.pools.local.spec, model.stage.config
    assert local.attn_layers == tuple(i for i in model.layers[0] if cfg.pattern[i] == "*")
    assert local.state_layers == tuple(i for i in model.layers[0] if cfg.pattern[i] in "MG")
    assert local.state_layers and not local.attn_layers  # stage 0 is attention-free
    params = {n.split(".")[2] for n, _ in model.stage.named_parameters() if ".layers." in n}
    assert params == {str(i) for i in model.layers[0]}
    assert not hasattr(model.stage, "lm_head")


def test_pipeline_samples_fork_on_every_stage_as_colocated(pp_engine, model_dir):
    """n samples: the fork's block and slot copies reach every stage (mirrored pools)."""
    s = SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True, n=3)
    ids = prompt(50, 37)

    def samples(eng) -> dict[int, list[int]]:
        eng.add_request(Request("n3", ids, s))
        got: dict[int, list[int]] = {}
        while eng.has_work:
            for o in eng.step():
                got.setdefault(o.sample, []).extend(o.new_token_ids)
        return got

    want = samples(engine_for(model_dir, worker=WORKER))
    assert samples(pp_engine) == want and len({tuple(v) for v in want.values()}) == 3
    pp_engine.cache.check_integrity()
