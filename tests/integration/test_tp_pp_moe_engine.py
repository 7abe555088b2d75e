"""TP 2 x PP 2 on a MoE model (four rank processes on one gloo world, each pipeline
stage's MoE layers split over its two TP ranks) gives the TP-1 engine's greedy tokens and
logprobs within 1e-4 on margin-filtered prompts (the cases of test_tp_moe_engine); canaries
clean; close leaves no process. Its own module: a TP engine of test_tp_moe_engine holds
that process's default group until its module ends."""

from __future__ import annotations

import pytest

from baton.worker.load import canary_audit
from tests.integration.test_tp_engine import WORKER, env, explain  # noqa: F401
from tests.integration.test_tp_moe_engine import _case, logprob_gaps, run
from tests.support.engine_helpers import engine_for


@pytest.mark.parametrize("family, split", [("nemotron_h", "within")])
def test_moe_tp2_pp2_tokens_and_logprobs_equal_tp1(family, split, tmp_path_factory,
                                                   env):  # noqa: F811
    """TP 2 x PP 2: each pipeline stage's MoE layers split over its two TP ranks, four
    processes on one gloo world; close leaves none. (`experts` and Qwen3.5-MoE pass here
    too; one case keeps the suite's time.)"""
    path, kept, ref, margins = _case(family, tmp_path_factory)
    eng = engine_for(path, worker={**WORKER, "tensor_parallel_size": 2,
                                   "pipeline_parallel_size": 2, "moe_tp_split": split})
    procs = eng.model.local_stages.procs
    try:
        assert len(procs) == 3  # world ranks 1..3
        got = run(eng, kept)
        got.pop("cached")
        toks, want = {k: v[0] for k, v in got.items()}, {k: v[0] for k, v in ref.items()}
        assert toks == want, explain(toks, want, margins)
        assert logprob_gaps(got, ref) == []
        eng.cache.check_integrity()
        audit = canary_audit(eng)
        assert audit["canary_bad_blocks"] == 0 and audit["canary_bad_slots"] == 0
    finally:
        eng.model.close()
    assert all(p.poll() is not None for p in procs.values())
