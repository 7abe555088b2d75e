"""One request's failure never fails its neighbours in the same engine step (issue 13, item 3)."""

from __future__ import annotations

import pytest
import torch

from baton.contract import FinishReason
from baton.engine.request import Request, SamplingParams
from baton.engine.sampler import Sampler
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

TINY_TEMPERATURES = [1e-38, 5e-324, 1e-300, 1e-30]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("isolation"))


def good_requests() -> list[Request]:
    """16 requests: greedy and seeded-sampled, of several prompt lengths."""
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=40, seed=11,
                            ignore_eos=True)
    return [Request(f"good{i}", prompt(100 + i, 3 + 7 * i), seeded if i % 2 else greedy(8))
            for i in range(16)]


def alone(model_dir, reqs: list[Request]) -> dict[str, list[int]]:
    """Each request alone in its engine's batch (one after the other), reuse off."""
    eng = engine_for(model_dir, cache={"enable_prefix_reuse": False})
    out = {}
    for r in reqs:
        fresh = Request(r.id, list(r.prompt_ids), r.sampling)
        out.update(run_all(eng, [fresh])["tokens"])
    return out


def interleave(good: list[Request], other: list[Request]) -> list[Request]:
    """good0, other0, good1, other1, ... then the rest of `good`: all in the same steps."""
    mixed = [r for pair in zip(good, other, strict=False) for r in pair]
    return mixed + good[len(other):]


def test_tiny_temperatures_draw_the_greedy_token_and_never_nan():
    logits = torch.tensor([[0.5, 3.0, -2.0, 2.9999, 1e4, -1e4]])
    for t in TINY_TEMPERATURES:
        for extra in ({}, {"top_k": 2}, {"top_p": 0.5}):
            p = SamplingParams(temperature=t, seed=1, **extra)
            (draw,) = Sampler().sample(logits, ["r"], [p])
            assert draw == (4, None), (t, extra)


def test_non_finite_logits_fail_only_that_draw():
    logits = torch.tensor([[0.0, 1.0, 2.0], [float("nan"), 1.0, 0.0], [0.0, float("inf"), 0.0]])
    p = SamplingParams(temperature=0.7, seed=3)
    draws = Sampler().sample(logits, ["a", "b", "c"], [p, p, p])
    assert draws[0].error is None and draws[0].token in (0, 1, 2)
    assert draws[1] == (None, "sampling failed: the model produced 1 non-finite logits for "
                              "request b")
    assert draws[2] == (None, "sampling failed: the model produced 1 non-finite logits for "
                              "request c")


def test_tiny_temperatures_beside_16_correct_requests(model_dir):
    good = good_requests()
    tiny = [Request(f"tiny{i}", prompt(200 + i, 5 + 9 * i),
                    SamplingParams(max_tokens=8, temperature=t, seed=i, ignore_eos=True,
                                   top_k=5 * (i % 2)))
            for i, t in enumerate(TINY_TEMPERATURES * 2)]
    as_greedy = [Request(r.id, r.prompt_ids, greedy(8)) for r in tiny]
    expected = {**alone(model_dir, good), **alone(model_dir, as_greedy)}
    eng = engine_for(model_dir, cache={"enable_prefix_reuse": False},
                     worker={"max_num_seqs": 32})
    res = run_all(eng, interleave(good, tiny))
    assert res["tokens"] == expected
    assert {o.finish_reason for o in res["outputs"].values()} == {FinishReason.LENGTH}
    eng.cache.check_integrity()


def test_a_request_whose_draw_fails_ends_alone_and_frees_everything(model_dir):
    """Requests `bad*` get NaN logits from the model on their decode steps: they fail with an
    error naming why, the 16 good ones in the same steps give exactly their tokens alone."""
    good = good_requests()
    bad = [Request(f"bad{i}", prompt(300 + i, 4 + 5 * i),
                   SamplingParams(max_tokens=8, temperature=0.9, seed=i, ignore_eos=True))
           for i in range(8)]
    expected = alone(model_dir, good)
    eng = engine_for(model_dir, cache={"enable_prefix_reuse": False},
                     worker={"max_num_seqs": 32})
    blocks, slots = eng.cache.num_free_blocks, eng.cache.num_free_slots
    real_decode = eng.model.decode

    def poisoned(ids, pos, tables, slots_t, pools):
        logits = real_decode(ids, pos, tables, slots_t, pools)
        bad_slots = {eng.cache.slot(r.id) for r in bad if r.id in eng.cache.live_requests()}
        for row, slot in enumerate(slots_t.tolist()):
            if slot in bad_slots:
                logits[row] = float("nan")
        return logits

    eng.model.decode = poisoned
    res = run_all(eng, interleave(good, bad))
    assert {k: v for k, v in res["tokens"].items() if k.startswith("good")} == expected
    for r in bad:
        out = res["outputs"][r.id]
        assert (out.finish_reason, len(res["tokens"][r.id])) == (FinishReason.ERROR, 1)
        assert out.error == (f"sampling failed: the model produced {eng.model.config.vocab_size} "
                             f"non-finite logits for request {r.id}")
    assert not eng.has_work and eng.requests == {}
    assert (eng.cache.num_free_blocks, eng.cache.num_free_slots) == (blocks, slots)
    eng.cache.check_integrity()


def test_a_request_the_pool_can_never_hold_fails_alone(model_dir):
    """Admission finds a request bigger than the whole pool while nothing runs: that request
    ends with ERROR; the one queued behind it runs normally."""
    eng = engine_for(model_dir, cache={"enable_prefix_reuse": False, "num_blocks": 8},
                     worker={"max_model_len": 4096})
    ok = Request("ok", prompt(1, 10), greedy(4))
    (expected,) = alone(model_dir, [ok]).values()
    huge = Request("huge", prompt(2, 200), greedy(4))  # 13 blocks of 16 tokens; the pool has 8
    for r in (huge, ok):  # as if validation had let it through
        eng.requests[r.id] = r
        eng.scheduler.add(r)
    outs = [o for _ in range(20) for o in eng.step()]
    assert [(o.request_id, o.finish_reason, o.error) for o in outs if o.finished] == [
        ("huge", FinishReason.ERROR, "request huge needs 13 KV blocks but the pool cannot free "
                                     "that many; raise cache.num_blocks or lower max_tokens"),
        ("ok", FinishReason.LENGTH, None),
    ]
    assert [t for o in outs if o.request_id == "ok" for t in o.new_token_ids] == expected
    assert eng.requests == {} and not eng.has_work
    eng.cache.check_integrity()
