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


def test_the_nextline_task_asks_for_the_true_next_held_out_line(tmp_path):
    """96 questions: 8 lines of a held-out file, then its next line among four distinct whole
    lines of that file; written the same every time. Above chance is 0.25 + 2.33 standard
    errors."""
    import json

    from baton.train.corpus import heldout
    from tests.clients.lm_eval import chance_bound
    from tests.clients.tasks import write_nextline_task

    write_nextline_task(tmp_path / "a")
    write_nextline_task(tmp_path / "b")
    text = (tmp_path / "a" / "nextline.jsonl").read_text()
    assert text == (tmp_path / "b" / "nextline.jsonl").read_text()
    docs = [json.loads(line) for line in text.splitlines()]
    files = [d.text for d in heldout()]
    assert len(docs) == 96
    assert {d["answer"] for d in docs} == {0, 1, 2, 3}
    for i, d in enumerate(docs):
        choices = d["choices"]
        assert len(set(choices)) == 4 and all(c.endswith("\n") for c in choices)
        assert d["context"].count("\n") == 8
        assert d["context"] + choices[d["answer"]] in files[i % len(files)]
    assert round(chance_bound(96), 3) == 0.353
