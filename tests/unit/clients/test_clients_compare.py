"""`make test-clients`' comparison of lm-eval runs fails on any difference that matters."""

from __future__ import annotations

import copy

from tests.clients.lm_eval import compare
from tests.clients.tasks import write_tasks


def _runs():
    mc = {0: {"filtered_resps": [[-3.5, False], [-2.25, True]], "acc": 1.0},
          1: {"filtered_resps": [[-1.0, True], [-4.0, False]], "acc": 0.0}}
    gen = {0: {"filtered_resps": [" 7"], "exact_match": 1.0}}
    return {"baton_mc": mc, "baton_gen": gen}


def test_equal_runs_and_small_loglikelihood_noise_pass():
    a, b = _runs(), _runs()
    b["baton_mc"][0]["filtered_resps"][0][0] += 9e-4
    assert compare(a, b) == []


def test_each_kind_of_difference_is_named():
    a = _runs()
    far, acc, text, missing = (copy.deepcopy(a) for _ in range(4))
    far["baton_mc"][1]["filtered_resps"][1][0] += 2e-3
    acc["baton_mc"][1]["acc"] = 1.0
    text["baton_gen"][0]["filtered_resps"] = [" 8"]
    del missing["baton_gen"][0]
    assert compare(a, far)[0].startswith("baton_mc doc 1: loglikelihoods differ by 2.00e-03")
    assert compare(a, acc)[0] == "baton_mc doc 1: acc Baton 0.0, hf 1.0"
    assert compare(a, text)[0] == "baton_gen doc 0: Baton generated [' 7'], hf [' 8']"
    assert compare(a, missing) == ["baton_gen: lm-eval scored 1 docs on Baton, 0 on hf"]


def test_tasks_are_written_deterministically(tmp_path):
    write_tasks(tmp_path / "a")
    write_tasks(tmp_path / "b")
    for name in ("mc.jsonl", "gen.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    assert len((tmp_path / "a" / "mc.jsonl").read_text().splitlines()) == 24
    assert "output_type: multiple_choice" in (tmp_path / "a" / "baton_mc.yaml").read_text()
