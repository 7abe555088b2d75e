"""n samples of one prompt: one prefill, the cache forked per sample, each sample exactly the
request of its own it replaces (seeded seed + i), and nothing left held afterwards."""

from __future__ import annotations

import pytest
import torch

from baton.contract.limits import check_samples, max_samples, sample_blocks
from baton.engine.request import Phase, Request, SamplingParams
from baton.errors import InvalidRequestError
from tests.support.engine_helpers import engine_for, prompt

TPB = 16


@pytest.fixture(scope="module")
def model_dir(model_tiny_dir):
    return model_tiny_dir  # the session's checkpoint: written once for every test module


def run(eng, reqs) -> dict[tuple[str, int], list[int]]:
    """Every sample's tokens by (request id, sample); also the finish reasons in `.reasons`."""
    for r in reqs:
        eng.add_request(r)
    toks: dict[tuple[str, int], list[int]] = {}
    for _ in range(10_000):
        if not eng.has_work:
            return toks
        for o in eng.step():
            toks.setdefault((o.request_id, o.sample), []).extend(o.new_token_ids)
            assert o.error is None, o.error
    raise AssertionError("no progress")


def alone(model_dir, ids, sampling: SamplingParams, n: int) -> list[list[int]]:
    """Sample i as a request of its own (seed + i), in a fresh engine."""
    return [run(engine_for(model_dir), [Request("x", ids, sampling.for_sample(i))])[("x", 0)]
            for i in range(n)]


def idle(eng) -> tuple[int, int]:
    return eng.cache.num_available_blocks, eng.cache.num_free_slots


def test_the_fork_shares_full_blocks_and_copies_the_tail_block_and_state(model_dir):
    eng = engine_for(model_dir, cache={"enable_prefix_reuse": False})
    ids = prompt(1, 40)  # 2 full blocks + 8 tokens
    eng.add_request(Request("a", ids, SamplingParams(max_tokens=4, ignore_eos=True, n=3)))
    while eng.requests["a"].phase is not Phase.DECODE:
        eng.step()  # the step that completes the prompt forks it
    cache, pools = eng.cache, eng.pools
    parent = cache.block_table("a")
    tables = [cache.block_table(i) for i in ("a#1", "a#2")]
    assert len(parent) == 3 and all(t[:2] == parent[:2] for t in tables)
    assert [cache.blocks.ref[b] for b in parent] == [3, 3, 1]
    tails = [parent[2]] + [t[2] for t in tables]
    assert len(set(tails)) == 3 and all(cache.blocks.ref[b] == 1 for b in tails)
    for b in tails[1:]:  # the first token is drawn, not yet fed: the copies are exact
        assert torch.equal(pools.kv[:, b], pools.kv[:, parent[2]])
    slots = [cache.slot(i) for i in ("a", "a#1", "a#2")]
    assert len(set(slots)) == 3
    for t in pools.state.values():
        for s in slots[1:]:
            assert torch.equal(t[:, s], t[:, slots[0]])
    cache.check_integrity()


def test_with_reuse_the_shared_blocks_are_tree_blocks_every_sample_locks(model_dir):
    eng = engine_for(model_dir)  # prefix reuse on
    eng.add_request(Request("a", prompt(12, 40), SamplingParams(max_tokens=6, ignore_eos=True,
                                                                n=3)))
    while eng.requests["a"].phase is not Phase.DECODE:
        eng.step()
    cache = eng.cache
    nodes = {n.block: n for n in cache.tree.nodes()}
    shared = cache.block_table("a")[:2]
    assert all(nodes[b].lock_ref == 3 for b in shared)  # the parent and its two samples
    assert [cache.blocks.ref[b] for b in shared] == [4, 4]  # + the tree's own reference
    assert eng.abort_sample("a", 0) == 2  # the first to end leaves them locked
    assert all(nodes[b].lock_ref == 2 for b in shared)
    cache.check_integrity()
    assert eng.abort("a") and all(nodes[b].lock_ref == 0 for b in shared)
    cache.check_integrity()


@pytest.mark.parametrize("reuse", [False, True])
def test_samples_equal_their_own_requests_and_the_prompt_is_computed_once(model_dir, reuse):
    eng = engine_for(model_dir, cache={"enable_prefix_reuse": reuse})
    before = idle(eng)
    ids = prompt(2, 37)
    seeded = SamplingParams(max_tokens=9, temperature=0.9, top_k=40, seed=11, ignore_eos=True,
                            frequency_penalty=0.7, presence_penalty=0.3, n=4)
    greedy = SamplingParams(max_tokens=9, ignore_eos=True, repetition_penalty=1.4, n=3)
    got = run(eng, [Request("s", ids, seeded), Request("g", prompt(3, 16), greedy)])
    assert eng.prefilled_tokens == 37 + 16
    want = alone(model_dir, ids, seeded, 4)
    assert [got[("s", i)] for i in range(4)] == want
    assert len({tuple(w) for w in want}) == 4  # the samples differ from each other
    (one,) = alone(model_dir, prompt(3, 16), greedy, 1)
    assert [got[("g", i)] for i in range(3)] == [one] * 3
    assert eng.requests == {} and eng.tracked()["sample_families"] == 0
    assert idle(eng) == before  # tree blocks (reuse) are evictable: available all the same
    eng.cache.check_integrity()


def test_a_stop_token_ends_its_sample_only(model_dir):
    ids = prompt(4, 21)
    base = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, n=3)
    free = alone(model_dir, ids, base, 3)
    stop = free[1][2]
    assert all(stop not in f[:8] for f in (free[0], free[2]))
    sampling = SamplingParams(**{**vars(base), "stop_token_ids": (stop,)})
    eng = engine_for(model_dir)
    got = run(eng, [Request("r", ids, sampling)])
    assert got[("r", 1)] == free[1][:3]
    assert got[("r", 0)] == free[0] and got[("r", 2)] == free[2]


def test_one_sample_aborted_leaves_its_siblings_and_abort_frees_the_rest(model_dir):
    eng = engine_for(model_dir)
    before = idle(eng)
    eng.add_request(Request("r", prompt(5, 30), SamplingParams(max_tokens=30, ignore_eos=True,
                                                               n=4)))
    for _ in range(4):
        eng.step()
    assert eng.abort_sample("r", 2) == 3
    assert eng.abort_sample("r", 2) is None
    assert sorted(eng.requests) == ["r", "r#1", "r#3"]
    for _ in range(3):
        eng.step()
    eng.cache.check_integrity()
    assert eng.abort("r")
    assert not eng.has_work and eng.requests == {} and len(eng.samples) == 0
    assert idle(eng) == before
    eng.cache.check_integrity()


def test_a_handoff_of_one_prompt_forks_on_the_decode_side(model_dir):
    """Prefill worker: one prompt, n first tokens; decode worker: the landed state forks."""
    ids = prompt(6, 45)
    sampling = SamplingParams(max_tokens=7, temperature=0.8, seed=21, ignore_eos=True, n=3)
    pre = engine_for(model_dir, cache={"enable_prefix_reuse": False})
    pre.add_request(Request("h", ids, sampling, prefill_only=True))
    outs = []
    while len(outs) < 3:
        outs.extend(pre.step())
    assert [o.sample for o in outs] == [0, 1, 2] and [o.open_samples for o in outs] == [2, 1, 0]
    assert sorted(pre.requests) == ["h"] and pre.prefilled_tokens == 45
    dec = engine_for(model_dir)
    before = idle(dec)
    adm = dec.reserve_remote(Request("h", ids, sampling))
    src = pre.cache.block_table("h")
    dec.pools.kv[:, adm.block_table] = pre.pools.kv[:, src]  # what the transfer writes
    for name, t in dec.pools.state.items():
        t[:, adm.slot] = pre.pools.state[name][:, pre.cache.slot("h")]
    pre.release("h")
    firsts = [o.new_token_ids[0] for o in outs]
    got = {}
    for o in dec.start_remote("h", firsts):
        got.setdefault(o.sample, []).extend(o.new_token_ids)
    while dec.has_work:
        for o in dec.step():
            got.setdefault(o.sample, []).extend(o.new_token_ids)
    assert [got[i] for i in range(3)] == alone(model_dir, ids, sampling, 3)
    assert dec.prefilled_tokens == 0 and dec.requests == {}
    assert idle(dec) == before
    dec.cache.check_integrity()


def test_n_beyond_what_the_cache_holds_is_refused_naming_n_and_the_limit(model_dir):
    eng = engine_for(model_dir, worker={"max_num_seqs": 4},
                     cache={"num_blocks": 40, "num_state_slots": 8})
    with pytest.raises(InvalidRequestError, match=r"^n=5 .* at most 4 such samples"):
        eng.add_request(Request("a", prompt(7, 20), SamplingParams(max_tokens=4, n=5)))
    # 100 prompt tokens (6 full blocks) + 140 each: 6 + n * 9 blocks must fit 40
    with pytest.raises(InvalidRequestError, match=r"^n=4 .* 42 KV blocks.*lower n to at most 3$"):
        eng.add_request(Request("b", prompt(8, 100), SamplingParams(max_tokens=140, n=4)))
    eng.add_request(Request("c", prompt(8, 100), SamplingParams(max_tokens=140, n=3)))
    assert eng.abort("c")
    assert eng.requests == {}
    eng.cache.check_integrity()
    assert sample_blocks(4, 100, 120, TPB) == 6 + 4 * 8
    assert max_samples(100, 140, 16, TPB, 40, 16) == 3
    check_samples(1, 100, 4000, 4096, 1, TPB, 1)  # one sample: nothing more to hold


def test_requests_wait_for_the_slots_of_all_their_samples(model_dir):
    eng = engine_for(model_dir, worker={"max_num_seqs": 4},
                     cache={"num_state_slots": 8})
    s = SamplingParams(max_tokens=5, ignore_eos=True, n=3)
    eng.add_request(Request("a", prompt(9, 10), s))
    eng.add_request(Request("b", prompt(10, 10), s))
    first = eng.step()
    assert eng.cache.live_room() == 1 and [r.id for r in eng.scheduler.waiting] == ["b"]
    toks = run(eng, [])
    for o in first:
        toks[(o.request_id, o.sample)] = [*o.new_token_ids, *toks[(o.request_id, o.sample)]]
    assert sorted(toks) == [(r, i) for r in "ab" for i in range(3)]
    assert all(len(t) == 5 for t in toks.values())
    eng.cache.check_integrity()


def test_baton_generate_local_gives_one_result_a_sample(model_dir):
    from baton.client.local import run_local
    from baton.client.requests import RequestSpec

    ids = prompt(11, 12)
    s = SamplingParams(max_tokens=4, temperature=0.7, seed=3, ignore_eos=True, n=2)
    specs = [RequestSpec("a", prompt_ids=ids, sampling=s),
             RequestSpec("b", prompt_ids=ids, sampling=s.for_sample(0))]
    out = run_local(engine_for(model_dir), specs, concurrency=2)
    assert [(r["id"], r.get("index")) for r in out] == [("a", 0), ("a", 1), ("b", None)]
    assert [r["token_ids"] for r in out] == [*alone(model_dir, ids, s, 2), out[0]["token_ids"]]


def test_the_loop_serves_every_sample_through_one_callback(model_dir):
    import queue

    from baton.engine.loop import EngineLoop

    eng = engine_for(model_dir)
    before = idle(eng)
    loop = EngineLoop(eng)
    try:
        box: queue.Queue = queue.Queue()
        s = SamplingParams(max_tokens=1000, ignore_eos=True, n=3)
        loop.submit(Request("L", prompt(13, 10), s), box.put)
        seen: set[int] = set()
        while len(seen) < 3:
            seen.add(box.get(timeout=30).sample)
        assert loop.abort_sample("L", 1) and not loop.abort_sample("L", 1)
        assert loop.abort("L")  # the client left: every sample still running
        outs = []
        while not (outs and outs[-1].finished and not outs[-1].open_samples):
            outs.append(box.get(timeout=30))
        ends = [(o.sample, o.finish_reason.value, o.open_samples) for o in outs if o.finished]
        assert ends == [(1, "abort", 2), (0, "abort", 0)]
        assert loop.tracked()["output_callbacks"] == 0
        assert loop.tracked()["sample_families"] == 0
        assert loop.call(idle, eng) == before
    finally:
        loop.stop()


def test_the_wire_carries_n_and_every_sample():
    from baton.contract import DecodeChunk, FinishReason, GenerateChunk, PrefillResult, wire
    from baton.contract.types import TokenLogprob

    s = SamplingParams(n=4, seed=3)
    assert wire.sampling_from_pb(wire.sampling_to_pb(s)) == s
    assert not wire.sampling_to_pb(SamplingParams()).HasField("n")
    lp = TokenLogprob(9, -0.5, ((9, -0.5),))
    r = PrefillResult(5, 16, False, None, lp, (lp,), samples=(
        PrefillResult(6, 16, True, FinishReason.STOP, lp), PrefillResult(7, 16)))
    assert wire.prefill_result_from_pb(wire.prefill_result_to_pb(r)) == r
    c = DecodeChunk((1, 2), FinishReason.LENGTH, sample=3)
    assert wire.decode_chunk_from_pb(wire.decode_chunk_to_pb(c)) == c
    g = GenerateChunk("r", (1,), "a", sample=2)
    assert wire.chunk_from_pb(wire.chunk_to_pb(g)) == g
