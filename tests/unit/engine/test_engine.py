"""Colocated engine: batching, chunking and arrivals never change the tokens; bad input is refused."""

from __future__ import annotations

import pytest

from baton.engine.request import Request, SamplingParams
from baton.errors import CapacityError, InvalidRequestError
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

LENGTHS = [1, 5, 16, 17, 40, 95]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def alone(model_dir):
    """Reference: each prompt alone in a fresh engine, reuse off."""
    ref = {}
    for i, n in enumerate(LENGTHS):
        eng = engine_for(model_dir, cache={"enable_prefix_reuse": False})
        res = run_all(eng, [Request(f"r{i}", prompt(i, n), greedy(12))])
        ref[f"r{i}"] = res["tokens"][f"r{i}"]
    return ref


def _reqs():
    return [Request(f"r{i}", prompt(i, n), greedy(12)) for i, n in enumerate(LENGTHS)]


def test_reference_is_not_degenerate(alone):
    assert all(len(t) == 12 for t in alone.values())
    assert len({tuple(t) for t in alone.values()}) == len(LENGTHS)
    assert any(len(set(t)) > 2 for t in alone.values())


def test_batched_decode_mixed_lengths_equals_alone(model_dir, alone):
    eng = engine_for(model_dir, cache={"enable_prefix_reuse": False})
    assert run_all(eng, _reqs())["tokens"] == alone
    eng.cache.check_integrity()


def test_continuous_batching_arrivals_equal_alone(model_dir, alone):
    eng = engine_for(model_dir, cache={"enable_prefix_reuse": False})
    arrivals = {"r0": 0, "r1": 3, "r2": 3, "r3": 7, "r4": 11, "r5": 20}
    assert run_all(eng, _reqs(), arrivals)["tokens"] == alone


@pytest.mark.parametrize("chunk", [5, 16, 33])
def test_chunked_prefill_equals_alone(model_dir, alone, chunk):
    eng = engine_for(
        model_dir,
        cache={"enable_prefix_reuse": False},
        worker={"prefill_chunk_size": chunk, "max_batch_tokens": 2 * chunk},
    )
    assert run_all(eng, _reqs())["tokens"] == alone


def test_pools_return_to_baseline(model_dir):
    eng = engine_for(model_dir, cache={"enable_prefix_reuse": False})
    blocks, slots = eng.cache.num_free_blocks, eng.cache.num_free_slots
    run_all(eng, _reqs())
    assert (eng.cache.num_free_blocks, eng.cache.num_free_slots) == (blocks, slots)
    eng.cache.check_integrity()


def test_seeded_sampling_repeats_and_ignores_batch(model_dir):
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    eng = engine_for(model_dir)
    a = run_all(eng, [Request("a", prompt(1, 20), sp)])["tokens"]["a"]
    mix = [Request("b", prompt(1, 20), sp), Request("c", prompt(2, 9), greedy(10))]
    b = run_all(engine_for(model_dir), mix)["tokens"]["b"]
    assert a == b
    other = SamplingParams(max_tokens=10, temperature=0.9, seed=8, ignore_eos=True)
    c = run_all(engine_for(model_dir), [Request("d", prompt(1, 20), other)])["tokens"]["d"]
    assert c != a


def test_max_tokens_and_stop_tokens(model_dir, alone):
    eng = engine_for(model_dir)
    ref = alone["r3"]
    stop = ref[4]
    first = ref.index(stop)
    sp = SamplingParams(max_tokens=12, stop_token_ids=(stop,), ignore_eos=True)
    res = run_all(eng, [Request("s", prompt(3, LENGTHS[3]), sp)])
    assert res["tokens"]["s"] == ref[: first + 1]
    assert res["outputs"]["s"].finish_reason == "stop"
    res = run_all(eng, [Request("m", prompt(3, LENGTHS[3]), greedy(3))])
    assert res["tokens"]["m"] == ref[:3]
    assert res["outputs"]["m"].finish_reason == "length"


@pytest.mark.parametrize(
    "ids, sp, msg",
    [
        ([], greedy(4), "prompt is empty"),
        ([5, 99999], greedy(4), "outside the vocabulary"),
        ([-1], greedy(4), "outside the vocabulary"),
        ([5] * 5000, greedy(4), "max model length"),
        ([5], SamplingParams(max_tokens=0), "max_tokens"),
        ([5], SamplingParams(temperature=-1.0), "temperature"),
        ([5], SamplingParams(top_p=0.0), "top_p"),
        ([5], SamplingParams(top_p=1.5), "top_p"),
        ([5], SamplingParams(top_k=-3), "top_k"),
        ([5], SamplingParams(stop_token_ids=(10**9,)), "stop_token_ids"),
    ],
)
def test_bad_requests_get_one_clear_error(model_dir, ids, sp, msg):
    eng = engine_for(model_dir, worker={"max_model_len": 4096})
    with pytest.raises(InvalidRequestError, match=msg):
        eng.add_request(Request("bad", ids, sp))
    assert not eng.has_work
    eng.cache.check_integrity()


def test_what_the_pool_or_model_can_never_hold_is_invalid(model_dir):
    eng = engine_for(model_dir, cache={"num_blocks": 8}, worker={"max_model_len": 4096})
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request(Request("big", prompt(1, 200), greedy(4)))
    assert str(e.value) == (
        "prompt + max_tokens (204 tokens) needs 13 KV blocks of 16 tokens but a worker's whole "
        "pool has 8 (cache.num_blocks); shorten the prompt or lower max_tokens")
    with pytest.raises(InvalidRequestError) as e:
        eng.reserve_remote(Request("long", prompt(1, 10), greedy(2**32 - 1)))
    assert str(e.value) == (
        f"prompt (10 tokens) + max_tokens ({2**32 - 1}) is {2**32 + 9} tokens, beyond the max "
        "model length 4096; lower max_tokens to at most 4086 or shorten the prompt")
    assert not eng.has_work and eng.requests == {}
    eng.cache.check_integrity()


def test_reservations_count_the_blocks_their_answers_will_take(model_dir):
    """A decode worker's reservations (prompts arriving by transfer) hold their prompt's blocks
    and count their answers' too: a reservation that would over-commit the pool is refused,
    not accepted to run out of blocks mid-answer. 16 blocks of 16 tokens: "a" holds 1 block
    for its prompt and will take 7 more; "b" needs 8, "c" then 1 more than is left."""
    eng = engine_for(model_dir, cache={"num_blocks": 16, "enable_prefix_reuse": False})
    eng.reserve_remote(Request("a", prompt(1, 10), greedy(118)))
    assert eng.cache.num_free_blocks == 15 and eng.scheduler.outstanding_blocks() == 7
    eng.reserve_remote(Request("b", prompt(2, 10), greedy(118)))
    with pytest.raises(CapacityError, match="no room for 1 KV blocks"):
        eng.reserve_remote(Request("c", prompt(3, 10), greedy(1)))
    eng.start_remote("a", 5)
    assert eng.scheduler.running == [eng.requests["a"]]
    assert [r.id for r in eng.scheduler.reserved] == ["b"]
    assert eng.scheduler.outstanding_blocks() == 14
    eng.abort("b")
    assert eng.scheduler.reserved == [] and eng.scheduler.outstanding_blocks() == 7
    eng.reserve_remote(Request("c", prompt(3, 10), greedy(1)))
    eng.abort("a")
    eng.abort("c")
    assert eng.cache.num_free_blocks == 16 and not eng.has_work
    eng.cache.check_integrity()


def test_abort_frees_everything(model_dir):
    eng = engine_for(model_dir)
    blocks, slots = eng.cache.num_free_blocks, eng.cache.num_free_slots
    eng.add_request(Request("x", prompt(5, 50), greedy(50)))
    eng.add_request(Request("y", prompt(6, 30), greedy(50)))
    for _ in range(4):
        eng.step()
    assert eng.abort("x") and eng.abort("y")
    assert not eng.abort("x")
    assert not eng.has_work
    eng.cache.check_integrity()
    assert eng.cache.num_free_slots == slots
    # reuse may keep snapshot blocks in the tree; they must all be evictable
    assert eng.cache.can_allocate(blocks)
