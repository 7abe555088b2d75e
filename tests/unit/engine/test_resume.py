"""A request resumed from prompt + the tokens so far continues with exactly the same tokens.

The router moves a request whose decode worker died (router/failover.py): another pair
prefills prompt + tokens already sent and decodes the rest. That is only correct because a
seeded draw depends on (seed, sequence position) alone and greedy on the state alone.
"""

from __future__ import annotations

import pytest
import torch

from baton.engine.request import Request, SamplingParams
from baton.engine.sampler import Sampler, draw_seed
from tests.support.engine_helpers import engine_for, make_checkpoint, prompt, run_all

SEEDED = SamplingParams(max_tokens=14, temperature=1.3, top_p=0.95, top_k=80, seed=21,
                        ignore_eos=True)
GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("resume"))


def test_a_seeded_draw_depends_only_on_seed_and_position():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=2.0, seed=5)

    def draws(sampler, rid, positions):
        return [sampler.sample(logits, [rid], [p], [pos])[0].token for pos in positions]

    one = Sampler()
    forward = draws(one, "a", range(12))
    # another sampler, another id, the positions in another order, each asked twice
    other = Sampler()
    backward = draws(other, "b", reversed(range(12)))[::-1]
    assert forward == backward == draws(other, "b", range(12))
    assert len(set(forward)) > 3  # really sampling, not one token
    assert forward != draws(Sampler(), "a", range(1, 13))
    assert draw_seed(5, 0) != draw_seed(5, 1) != draw_seed(6, 0)
    assert all(0 <= draw_seed(s, q) < 2**63 for s in (0, 2**63, 2**64 - 1) for q in (0, 10**9))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefilling_the_tokens_so_far_continues_identically(model_dir, sampling):
    ids = prompt(40, 37)
    whole = run_all(engine_for(model_dir), [Request("w", ids, sampling)])["tokens"]["w"]
    assert len(whole) == 14 and len(set(whole)) > 2
    for k in (1, 5, 13):
        rest = SamplingParams(**{**vars(sampling), "max_tokens": 14 - k})
        # a fresh engine (another worker), another request id: only seed and position matter
        got = run_all(engine_for(model_dir), [Request(f"m{k}", ids + whole[:k], rest)])
        assert got["tokens"][f"m{k}"] == whole[k:], k


def test_a_prefill_waits_for_slots_held_by_handoffs_instead_of_failing(model_dir):
    """Prefill side: a finished prefill keeps its live slot until its handoff is released;
    with every slot so held and nothing running, a new request waits, it is not refused."""
    eng = engine_for(model_dir, worker={"max_num_seqs": 1})
    first = Request("h1", prompt(50, 20), GREEDY, prefill_only=True)
    out = run_all(eng, [first])
    assert len(out["tokens"]["h1"]) == 1  # computed; its slot is held for the handoff
    eng.add_request(Request("h2", prompt(51, 20), GREEDY, prefill_only=True))
    for _ in range(3):
        assert [o for o in eng.step() if o.request_id == "h2"] == []  # waiting, not failed
    eng.release("h1")
    got = []
    while not got:
        got = [o for o in eng.step() if o.request_id == "h2" and o.finished]
    assert got[0].error is None and len(got[0].new_token_ids) == 1
