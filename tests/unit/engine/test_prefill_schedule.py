"""Prefill scheduling policies: exact per-step order, the age bound, and unchanged tokens."""

from __future__ import annotations

import typing

import pytest

from baton.config import BatonConfig, WorkerConfig
from baton.engine.request import Request
from baton.engine.scheduler import PREFILL_ORDERS
from baton.errors import ConfigError
from tests.support.engine_helpers import engine_for, greedy, prompt, run_all


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def engine(model_dir, schedule: str, max_wait_s: float = 100.0):
    eng = engine_for(model_dir, worker={
        "max_batch_tokens": 64, "prefill_chunk_size": 64,
        "prefill_schedule": schedule, "prefill_max_wait_s": max_wait_s,
    })
    eng.scheduler.clock = clock = Clock()
    steps: list[list[tuple[str, int]]] = []
    plan_of = eng.scheduler.schedule

    def recorded():
        plan = plan_of()
        steps.append([(r.id, end) for r, end in plan.prefills])
        return plan

    eng.scheduler.schedule = recorded
    return eng, clock, steps


def mixed_queue(eng) -> list[Request]:
    """Two fresh prompts (96 and 80 tokens), then one whose first 100 tokens are cached: the
    previous turn (96 prompt + 4 answer tokens, decode-end snapshot) plus 8 new tokens."""
    first = prompt(1, 96)
    answer = run_all(eng, [Request("turn1", first, greedy(4))])["tokens"]["turn1"]
    return [
        Request("full96", prompt(2, 96), greedy(3), arrival=0.0),
        Request("full80", prompt(3, 80), greedy(3), arrival=0.0),
        Request("hit", first + answer + prompt(4, 8), greedy(3), arrival=0.0),
    ]


def run(eng, steps, reqs):
    steps.clear()
    out = run_all(eng, reqs)
    eng.cache.check_integrity()
    return [s for s in steps if s], out


def test_fcfs_makes_the_cached_prompt_wait_behind_both_full_prefills(model_tiny_dir):
    eng, _, steps = engine(model_tiny_dir, "fcfs")
    prefills, out = run(eng, steps, mixed_queue(eng))
    assert prefills == [
        [("full96", 64)],
        [("full96", 96), ("full80", 32)],
        [("full80", 80), ("hit", 108)],
    ]
    assert out["outputs"]["hit"].cached_tokens == 100


def test_fewest_uncached_first_serves_the_cached_prompt_in_the_first_step(model_tiny_dir):
    eng, _, steps = engine(model_tiny_dir, "fewest_uncached_first")
    prefills, out = run(eng, steps, mixed_queue(eng))
    assert prefills == [
        [("hit", 108), ("full80", 56)],
        [("full80", 80), ("full96", 40)],
        [("full96", 96)],
    ]
    assert out["outputs"]["hit"].cached_tokens == 100


def test_the_order_changes_no_token(model_tiny_dir):
    tokens = {}
    for name in PREFILL_ORDERS:
        eng, _, steps = engine(model_tiny_dir, name)
        tokens[name] = run(eng, steps, mixed_queue(eng))[1]["tokens"]
    assert tokens["fcfs"] == tokens["fewest_uncached_first"]
    assert all(len(t) == 3 for t in tokens["fcfs"].values())


def starve(model_dir, max_wait_s: float, steps_run: int = 8):
    """A 96-token prompt arrives at t=0; every step (0.3 s apart) brings two fresh 32-token
    prompts, which alone fill the 64-token budget. Returns the recorded prefills per step."""
    eng, clock, steps = engine(model_dir, "fewest_uncached_first", max_wait_s)
    eng.add_request(Request("old", prompt(50, 96), greedy(1), arrival=0.0))
    for step in range(steps_run):
        clock.t = 0.3 * step
        for k in range(2):
            eng.add_request(Request(f"new{step}.{k}", prompt(100 + 2 * step + k, 32), greedy(1),
                                    arrival=clock.t))
        eng.step()
    return steps


def test_without_an_age_bound_the_long_prompt_starves(model_tiny_dir):
    steps = starve(model_tiny_dir, float("inf"))
    assert all(rid != "old" for step in steps for rid, _ in step)
    assert steps[5] == [("new5.0", 32), ("new5.1", 32)]


def test_an_old_request_is_served_first_once_it_reaches_the_age_bound(model_tiny_dir):
    steps = starve(model_tiny_dir, 1.0)
    # t = 0.0, 0.3, 0.6, 0.9: the fresh short prompts go first; t = 1.2 >= 1.0: "old" leads
    assert [[rid for rid, _ in s] for s in steps[:4]] == [["new0.0", "new0.1"]] + [
        [f"new{i}.0", f"new{i}.1"] for i in range(1, 4)
    ]
    assert steps[4] == [("old", 64)]
    # the rest of the budget goes to the backlog: equal uncached counts, so admission order
    assert steps[5] == [("old", 96), ("new4.0", 32)]
    assert steps[6] == [("new4.1", 32), ("new5.0", 32)]


def test_policy_names_in_the_config_are_the_policies_in_the_scheduler():
    field = typing.get_type_hints(WorkerConfig)["prefill_schedule"]
    assert set(typing.get_args(field)) == set(PREFILL_ORDERS)
    assert WorkerConfig().prefill_schedule in PREFILL_ORDERS


@pytest.mark.parametrize(("worker", "message"), [
    ({"prefill_schedule": "sjf"}, r"worker.prefill_schedule must be one of \['fcfs'"),
    ({"prefill_max_wait_s": -1}, r"prefill_max_wait_s must be >= 0 seconds, got -1"),
])
def test_bad_schedule_keys_are_refused_by_name(worker, message):
    with pytest.raises(ConfigError, match=message):
        BatonConfig.from_dict({"worker": worker})
