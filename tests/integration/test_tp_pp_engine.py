"""TP 2 x PP 2 (four rank processes on one gloo world, each pipeline stage split over two
TP ranks) gives exactly the TP-1 engine's greedy tokens in float32, with chunked prefill,
micro-batches, batched decode and prefix reuse, on n_groups 4 / KV 2 and n_groups 1 / KV 1
and Qwen3.5 (margin-filtered prompts, as in test_tp_engine); canaries clean on all four
ranks; close
leaves no process."""

from __future__ import annotations

import pytest

from baton.worker.load import canary_audit
from tests.integration.test_tp_engine import WORKER, case, env, explain, reqs  # noqa: F401
from tests.support.engine_helpers import engine_for, run_all


# the two configs that replicate the most (B/C and the only KV head; Qwen3.5's key heads)
@pytest.mark.parametrize("case", ["groups1-kv1", "qwen3_5"], indirect=True)
def test_tp2_pp2_tokens_and_reuse_equal_tp1(case):  # noqa: F811
    path, kept, follow, ref, ref2, margins = case
    eng = engine_for(path, worker={**WORKER, "tensor_parallel_size": 2,
                                   "pipeline_parallel_size": 2})
    procs = eng.model.local_stages.procs
    try:
        assert len(procs) == 3  # world ranks 1..3: stage 1's leader, both stages' TP rank 1
        got = run_all(eng, reqs(kept))["tokens"]
        assert got == ref, explain(got, ref, margins)
        res = run_all(eng, reqs(follow))
        assert res["tokens"] == ref2, explain(res["tokens"], ref2, {})
        assert sum(o.cached_tokens for o in res["outputs"].values()) > 0
        eng.cache.check_integrity()
        audit = canary_audit(eng)  # stage 0's pools, stage 1's leader and both TP ranks 1
        assert audit["canary_bad_blocks"] == 0 and audit["canary_bad_slots"] == 0
        assert audit["canary_blocks_checked"] > 0 and audit["canary_slots_checked"] > 0
        cfg, local = eng.model.config, eng.model.pools.local  # stage 0: its layers, its shard
        first = eng.model.layers[0]
        assert local.spec.state_layers == tuple(i for i in cfg.state_layers if i in first)
        assert local.spec.attn_layers == tuple(i for i in cfg.attention_layers if i in first)
        assert local.kv.shape[-2] == 1  # 2 KV heads (or 1) over 2 TP ranks
    finally:
        eng.model.close()
    assert all(p.poll() is not None for p in procs.values())
