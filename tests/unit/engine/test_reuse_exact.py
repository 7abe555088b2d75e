"""Prefix reuse is exact: reuse on gives the tokens of reuse off, and reuses what DOMAIN.md predicts."""

from __future__ import annotations

import pytest

from baton.engine.request import Request
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

POLICIES = {
    "final": {"additional_snapshot_offsets_from_end": [0], "decode_end_snapshot": False},
    "periodic": {
        "periodic_snapshot_interval": 16,
        "additional_snapshot_offsets_from_end": [],
        "decode_end_snapshot": False,
    },
    "start_end": {
        "additional_snapshot_offsets_from_start": [20, 45],
        "additional_snapshot_offsets_from_end": [0, 5],
        "decode_end_snapshot": False,
    },
    "decode_end": {"additional_snapshot_offsets_from_end": [0], "decode_end_snapshot": True},
    "periodic_decode_end": {
        "periodic_snapshot_interval": 32,
        "additional_snapshot_offsets_from_end": [0, 16],
        "decode_end_snapshot": True,
    },
    "per_conversation": {"per_conversation": True, "max_num_turns": 3},
}


@pytest.fixture(scope="module", params=["tiny", "second", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse")
    if request.param == "tiny":
        return make_checkpoint(root)
    if request.param == "qwen3_5":  # DeltaNet + gated attention, attention first
        return make_checkpoint(root, "qwen", family="qwen3_5", pattern="*GG*G", seed=5)
    return make_checkpoint(root, "second", pattern="*MM-*M", hidden_size=48, seed=11)


def _engine(model_dir, policy: str | None):
    if policy is None:
        return engine_for(model_dir, cache={"enable_prefix_reuse": False, "tokens_per_block": 16})
    return engine_for(
        model_dir, cache={"tokens_per_block": 16, "mamba_state_config": POLICIES[policy]}
    )


def _chat(engine, turns: int = 6, answer: int = 7, session: str = "s1"):
    history: list[int] = []
    toks, cached = [], []
    for t in range(turns):
        p = history + prompt(100 + t, 9 + 5 * t)
        res = run_all(engine, [Request(f"t{t}", p, greedy(answer), session=session)])
        out = res["tokens"][f"t{t}"]
        toks.append(out)
        cached.append(res["outputs"][f"t{t}"].cached_tokens)
        history = p + out
    return toks, cached


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_six_turn_chat_equals_reuse_off(model_dir, policy):
    ref, ref_cached = _chat(_engine(model_dir, None))
    eng = _engine(model_dir, policy)
    got, cached = _chat(eng)
    assert got == ref
    assert ref_cached == [0] * 6
    # periodic-only snapshots need a prompt past 16 tokens first: turn 2 creates, turn 3 reuses
    first_hit = 2 if policy == "periodic" else 1
    assert cached[:first_hit] == [0] * first_hit and all(c > 0 for c in cached[first_hit:])
    eng.cache.check_integrity()


def test_decode_end_snapshot_reuses_whole_previous_turn(model_dir):
    eng = _engine(model_dir, "decode_end")
    history, expected = [], []
    cached = []
    for t in range(6):
        p = history + prompt(200 + t, 11)
        res = run_all(eng, [Request(f"t{t}", p, greedy(6), session="c")])
        expected.append(len(history))
        cached.append(res["outputs"][f"t{t}"].cached_tokens)
        history = p + res["tokens"][f"t{t}"]
    assert cached == expected


FORK_LENGTHS = [1, 15, 16, 17, 32, 33, 44, 45, 46, 48, 49, 63, 64]
_REF: dict = {}


def _reference(model_dir, ids: list[int], n: int) -> list[int]:
    """Reuse-off tokens for `ids`, computed once per module."""
    key = (str(model_dir), tuple(ids), n)
    if key not in _REF:
        eng = _engine(model_dir, None)
        _REF[key] = run_all(eng, [Request("ref", ids, greedy(n))])["tokens"]["ref"]
    return _REF[key]


@pytest.mark.parametrize("policy", ["periodic", "start_end", "final"])
def test_forks_around_boundaries(model_dir, policy):
    base = prompt(7, 64)
    for shared in FORK_LENGTHS:
        fork = base[:shared] + prompt(1000 + shared, 12)
        eng = _engine(model_dir, policy)
        run_all(eng, [Request("base", base, greedy(1))])
        points = eng.cache.snapshot_points(len(base))
        res = run_all(eng, [Request("fork", fork, greedy(5))])
        assert res["tokens"]["fork"] == _reference(model_dir, fork, 5), f"shared={shared}"
        want = max([p for p in points if p <= shared and p <= len(fork) - 1], default=0)
        assert res["outputs"]["fork"].cached_tokens == want, f"shared={shared} points={points}"
        eng.cache.check_integrity()


def test_exact_repeat_reuses_previous_snapshot(model_dir):
    """DOMAIN.md: 16-token blocks, snapshots at 16, 32, 48: a repeat reuses 32, a 40-token share 32."""
    eng = _engine(model_dir, "periodic")
    p = prompt(3, 48)
    assert eng.cache.snapshot_points(48) == [16, 32, 48]
    first = run_all(eng, [Request("a", p, greedy(8))])
    again = run_all(eng, [Request("b", p, greedy(8))])
    assert again["tokens"]["b"] == first["tokens"]["a"]
    assert again["outputs"]["b"].cached_tokens == 32
    share40 = p[:40] + prompt(4, 8)
    res = run_all(eng, [Request("c", share40, greedy(8))])
    assert res["outputs"]["c"].cached_tokens == 32
    ref = run_all(_engine(model_dir, None), [Request("c", share40, greedy(8))])
    assert res["tokens"]["c"] == ref["tokens"]["c"]


def test_concurrent_sharers_equal_reuse_off(model_dir):
    base = prompt(9, 50)
    reqs = lambda: [Request(f"q{i}", base[: 20 + 7 * i] + prompt(50 + i, 5), greedy(6)) for i in range(5)]  # noqa: E731
    ref = run_all(_engine(model_dir, None), reqs())["tokens"]
    eng = _engine(model_dir, "periodic_decode_end")
    run_all(eng, [Request("warm", base, greedy(3))])
    assert run_all(eng, reqs())["tokens"] == ref
    eng.cache.check_integrity()


def test_requests_arriving_together_share_a_prefix_in_flight(model_dir):
    """Four sessions start on one 64-token system prompt in the same step: the first
    computes it, the others wait for its snapshot at 64 and reuse it (exact tokens)."""
    system = prompt(21, 64)
    reqs = lambda: [Request(f"s{i}", system + prompt(40 + i, 9), greedy(5)) for i in range(4)]  # noqa: E731
    ref = run_all(_engine(model_dir, None), reqs())["tokens"]
    eng = _engine(model_dir, "periodic")
    res = run_all(eng, reqs())
    assert res["tokens"] == ref
    assert [res["outputs"][f"s{i}"].cached_tokens for i in range(4)] == [0, 64, 64, 64]
    eng.cache.check_integrity()
