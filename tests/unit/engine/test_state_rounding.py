"""bf16 state with stochastic rounding at the policy's points keeps reuse exact: a prompt
that reuses a snapshot at a prompt-internal point gives the tokens and the logprobs, bit for
bit, of an engine with reuse off; and the rounding really happens (float32 state differs)."""

from __future__ import annotations

import pytest
import torch

from baton.engine.request import Request
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_alone

POLICY = {"additional_snapshot_offsets_from_start": [20],
          "additional_snapshot_offsets_from_end": [0], "decode_end_snapshot": False}
SR = {"state_dtype": "bfloat16", "state_rounding": "stochastic", "state_rounding_seed": 3}


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"round-{request.param}")
    if request.param == "qwen3_5":
        return make_checkpoint(root, "qwen", family="qwen3_5", pattern="GG*G", seed=4)
    return make_checkpoint(root, pattern="M*M-M", seed=4)


def _engine(model_dir, reuse: bool, **fmt):
    return engine_for(model_dir, worker={"prefill_chunk_size": 64},
                      cache={"tokens_per_block": 16, "enable_prefix_reuse": reuse,
                             "mamba_state_config": POLICY, **fmt})




def run_until_done(eng, rid: str):
    """(tokens, logprobs, cached_tokens) of request `rid`, already added."""
    toks, lps, cached = [], [], None
    while cached is None:
        for o in eng.step():
            assert o.request_id == rid
            toks += o.new_token_ids
            lps += [lp.logprob for lp in o.logprobs or ()]
            if o.finished:
                cached = o.cached_tokens
    return toks, lps, cached


@pytest.mark.parametrize("kv", ["model", "float8_e4m3"])
def test_reuse_at_a_prompt_internal_point_equals_reuse_off(model_dir, kv):
    """Also with fp8 KV beside the bf16 state (both formats at once)."""
    a = prompt(1, 40)
    b = a[:20] + prompt(2, 25)
    sr = {**SR, "kv_dtype": kv}
    off, on = _engine(model_dir, False, **sr), _engine(model_dir, True, **sr)
    assert off.rounding is not None and off.rounding.points(45) == (20, 45)
    run_alone(off, "a", a)
    ref = run_alone(off, "b", b)
    run_alone(on, "a", a)
    got = run_alone(on, "b", b)
    assert got[2] == 20 and ref[2] == 0  # b restored the snapshot at 20
    assert got[0] == ref[0] and got[1] == ref[1]  # tokens and logprobs, bit for bit
    snap = on.cache.tree.match(a, 20).snapshot  # the snapshot sits in the snapshot-only pool
    assert snap is not None and snap.slot >= on.pools.spec.num_slots
    for name, pool in on.pools.snapshots.items():  # which really stores bfloat16
        assert pool.dtype == torch.bfloat16 and on.pools.state[name].dtype == torch.float32
    spec = on.pools.spec  # snapshots take half the bytes of a live slot
    assert 2 * spec.snapshot_bytes_per_slot() == spec.state_bytes_per_slot()
    plain = _engine(model_dir, False, kv_dtype=kv)
    assert plain.rounding is None
    run_alone(plain, "a", a)
    assert run_alone(plain, "b", b)[1] != ref[1]  # float32 state gives other logprobs


def test_two_runs_agree_and_another_seed_draws_differently(model_dir):
    a = prompt(3, 45)
    one, two = _engine(model_dir, True, **SR), _engine(model_dir, True, **SR)
    assert run_alone(one, "a", a) == run_alone(two, "a", a)
    other = _engine(model_dir, True, **{**SR, "state_rounding_seed": 4})
    assert run_alone(other, "a", a)[1] != run_alone(one, "a2", a)[1]  # another seed, other draws


def test_chat_reusing_periodic_points_is_bit_exact(model_dir):
    """Periodic points are absolute positions: every turn of a chat reuses one that the cold
    run also rounded, so reuse on equals reuse off in tokens and logprobs, turn by turn."""
    periodic = {"periodic_snapshot_interval": 16, "additional_snapshot_offsets_from_end": [],
                "decode_end_snapshot": False}

    def chat(reuse: bool):
        eng = engine_for(model_dir, cache={"tokens_per_block": 16, "enable_prefix_reuse": reuse,
                                           "mamba_state_config": periodic, **SR})
        history, turns = [], []
        for t in range(4):
            p = history + prompt(100 + t, 9 + 5 * t)
            turns.append(run_alone(eng, f"t{t}", p))
            history = p + turns[-1][0]
        return turns

    off, on = chat(False), chat(True)
    cached = [c for _, _, c in on]
    assert cached == [0, 0, 16, 48] and [c for _, _, c in off] == [0] * 4
    assert [(t, lp) for t, lp, _ in on] == [(t, lp) for t, lp, _ in off]


@pytest.mark.parametrize("kv", ["model", "float8_e4m3"])
def test_speculation_on_equals_off_with_rounded_state(tmp_path, kv):
    """Greedy chat turns speculate (K=3, an MTP head that agrees a third of the time): their
    tokens equal speculation off, and the last turn, which reuses the previous decode-end
    snapshot and asks for logprobs, has the same logprobs bit for bit: the state that
    speculation verified and rounded is the state plain decoding rounded. With fp8 KV beside
    the bf16 state: the same tokens and reuse, but not every bit of the logprobs (the verify
    pass reads fp8 KV on the reference path, whose float32 sums run in another order than
    the decode kernel's; docs/state-precision.md)."""
    from tests.support.speculative_helpers import agreeing_checkpoint

    ck = agreeing_checkpoint(tmp_path)
    policy = {"periodic_snapshot_interval": 16, "decode_end_snapshot": True}

    def chat(k: int):
        eng = engine_for(ck, speculative={"num_draft_tokens": k}, worker={"max_num_seqs": 4},
                         cache={"tokens_per_block": 16, "num_state_slots": 32,
                                "mamba_state_config": policy, **SR, "kv_dtype": kv})
        history, turns = [], []
        for t in range(4):
            p = history + prompt(200 + t, 7 + 6 * t)
            rid = f"t{t}"
            eng.add_request(Request(rid, p, greedy(12, logprobs=1 if t == 3 else None)))
            out = run_until_done(eng, rid)
            turns.append(out)
            history = p + out[0]
        return eng, turns

    off_eng, off = chat(0)
    on_eng, on = chat(3)
    assert on_eng.rounding is not None and on_eng.spec.accepted_tokens > 0
    assert off[3][1] and off[3][2] > 0  # the last turn reused a snapshot
    if kv == "model":
        assert on == off
        return
    assert [(t, c) for t, _, c in on] == [(t, c) for t, _, c in off]
    assert max(abs(a - b) for a, b in zip(on[3][1], off[3][1], strict=True)) < 1e-4


def test_tp_ranks_number_their_shard_as_the_whole_tensor():
    """A conv slot [x (I=4 rows) | B (2) | C (2)] x 3 taps, 1 group: at TP 2 rank r holds x
    rows [2r, 2r+2) and every B and C row (replicated), numbered as in the TP 1 tensor; so
    rounding a rank's shard with `index` gives the TP 1 result's elements, bit for bit."""
    from baton.cache.rounding import round_state
    from baton.engine.state_rounding import tp1_index
    from baton.model.state_spec import StateTensorSpec

    conv = StateTensorSpec("conv", (8, 3), sections=(4, 2, 2), section_names=("x", "B", "C"),
                           section_units=(4, 1, 1))
    rows = {r: (tp1_index(conv, 2, r) // 3)[:, 0].tolist() for r in (0, 1)}
    assert rows == {0: [0, 1, 4, 5, 6, 7], 1: [2, 3, 4, 5, 6, 7]}
    assert tp1_index(conv, 1, 0).flatten().tolist() == list(range(24))
    x = torch.randn(2, 8, 3)
    keys = torch.tensor([5, 9])
    whole = round_state(x, torch.bfloat16, "stochastic", keys).flatten(1)
    for r in (0, 1):
        idx = tp1_index(conv, 2, r)
        shard = x.flatten(1)[:, idx.flatten()].view(2, *idx.shape)
        got = round_state(shard, torch.bfloat16, "stochastic", keys, idx)
        assert torch.equal(got.flatten(1), whole[:, idx.flatten()])
