"""Steps without drafts (`speculative.max_batch`): they decode plainly (no verify pass), the MTP
head's entries wait for their reader (the next draft's first pass, a decode-end snapshot) and
are exactly the entries written every step: the same drafts are accepted, greedy output equals
speculation off, whatever the pending rows' bound."""

from __future__ import annotations

import random

import pytest
import torch

from baton.engine.request import Request
from baton.engine.speculative.decoder import SpeculativeDecoder
from tests.support.engine_helpers import engine_for, greedy, run_all
from tests.support.speculative_helpers import agreeing_checkpoint

pytestmark = pytest.mark.usefixtures("model_single_thread")


@pytest.fixture(scope="module")
def context_head(tmp_path_factory):
    """The agreeing head with a hidden-dependent eh_proj half and an attention that adds to
    its output: its drafts then depend on its KV entries, and they on the target hiddens
    they were computed from (a wrong or missing pending row changes what is accepted)."""
    from safetensors.torch import load_file, save_file

    ck = agreeing_checkpoint(tmp_path_factory.mktemp("spec_rule"), "ctx_head")
    f = ck / "model.safetensors"
    t = load_file(str(f))
    H = t["mtp.layers.0.eh_proj.weight"].shape[0]
    g = torch.Generator().manual_seed(5)
    t["mtp.layers.0.eh_proj.weight"][:, H:] = torch.randn(H, H, generator=g) * 0.3 / H**0.5
    o = t["mtp.layers.0.mixer.o_proj.weight"]
    t["mtp.layers.0.mixer.o_proj.weight"] = torch.randn(o.shape, generator=g) * 2 / H**0.5
    save_file(t, str(f), metadata={"format": "pt"})
    return ck


def _requests() -> tuple[list[Request], dict[str, int]]:
    """12 greedy requests arriving over time: the batch rises above max_batch (no drafts,
    entries pending for up to ~20 steps) and falls back under it (drafts read them)."""
    rng = random.Random(3)
    lengths = [50, 45, 22, 12, 30, 18, 40, 16, 25, 14, 35, 20]
    reqs = [Request(f"q{i}", [rng.randrange(3, 512) for _ in range(5 + 7 * i)],
                    greedy(n)) for i, n in enumerate(lengths)]
    steps = [0, 0, 0, 2, 3, 4, 30, 31, 32, 55, 56, 70]
    return reqs, {f"q{i}": s for i, s in enumerate(steps)}


def _run(ck, speculative: dict | None, lag_rows: int | None = None):
    eng = engine_for(ck, worker={"max_num_seqs": 8}, **(
        {"speculative": {"max_batch": 2, **speculative}} if speculative else {}))
    calls: dict = {"plain": 0, "verify": 0, "first_pass_rows": 0}
    if eng.spec is not None:
        if lag_rows is not None:
            eng.spec.pending.lag_rows = lag_rows
        plain, verify, draft = eng.spec._plain_step, eng.spec._verify, eng.spec.drafter.draft

        def count_draft(jobs):  # the most pending rows a request's first pass wrote
            calls["first_pass_rows"] = max(calls["first_pass_rows"],
                                           *(len(j.next_ids) for j in jobs))
            return draft(jobs)

        def count_plain(*a):
            calls["plain"] += 1
            return plain(*a)

        def count_verify(rows):  # every verify pass checks at least one draft
            calls["verify"] += 1
            assert max(len(r.tokens) for r in rows) > 1
            return verify(rows)

        eng.spec._plain_step, eng.spec._verify = count_plain, count_verify
        eng.spec.drafter.draft = count_draft
        # each finished request's head KV as its decode-end snapshot keeps it: every
        # position but the last (that entry lags one token)
        layer = eng.pools.spec.attn_index[eng.model.mtp.attention_layers[0]]
        finish = eng.cache.finish

        def capture(rid, tokens):
            rows = torch.cat([eng.pools.kv[layer, b] for b in eng.cache.block_table(rid)], 1)
            calls.setdefault("kv", {})[rid] = (list(tokens), rows[:, : len(tokens) - 1].clone())
            return finish(rid, tokens)

        eng.cache.finish = capture
    reqs, arrivals = _requests()
    out = run_all(eng, reqs, arrivals)
    counts = None
    if eng.spec is not None:
        s = eng.spec
        counts = (s.draft_tokens, s.accepted_tokens, tuple(s.accepted_hist))
    return out["tokens"], counts, calls


@pytest.mark.parametrize("k", [1, 3])
def test_steps_without_drafts_decode_plainly_and_accept_the_same_drafts(context_head, k,
                                                                        monkeypatch):
    off, _, _ = _run(context_head, None)
    lazy, counts, calls = _run(context_head, {"num_draft_tokens": k})
    assert lazy == off
    assert calls["plain"] > 10 and calls["verify"] > 10  # both kinds of step ran
    assert calls["first_pass_rows"] > 16  # a draft wrote the entries steps left pending
    assert counts[1] > 0 and counts[0] > counts[1]
    # a bound of 2 pending rows (written as the third arrives), and entries written every
    # step (no waiting): the same entries, so the same drafts are accepted
    bounded, counts_bounded, bcalls = _run(context_head, {"num_draft_tokens": k}, lag_rows=2)
    assert bcalls["first_pass_rows"] <= k + 1
    monkeypatch.setattr(SpeculativeDecoder, "_lazy", lambda self: False)
    eager, counts_eager, ecalls = _run(context_head, {"num_draft_tokens": k})
    assert bounded == eager == off
    assert counts_bounded == counts_eager == counts
    kv, kv_bounded, kv_eager = calls["kv"], bcalls["kv"], ecalls["kv"]
    assert sorted(kv) == sorted(kv_eager) == sorted(f"q{i}" for i in range(12))
    assert all(torch.equal(kv[r][1], kv_eager[r][1])
               and torch.equal(kv_bounded[r][1], kv_eager[r][1]) for r in kv)
    # and they are the entries a prefill of the same tokens writes (target hiddens, never
    # a draft's; another kernel, so close, not equal)
    ref = engine_for(context_head, worker={"max_num_seqs": 4},
                     speculative={"num_draft_tokens": k})
    layer = ref.pools.spec.attn_index[ref.model.mtp.attention_layers[0]]
    for rid, (tokens, got) in kv.items():
        ref.add_request(Request(rid, tokens, greedy(1), prefill_only=True))
        ref.step()
        rows = torch.cat([ref.pools.kv[layer, b] for b in ref.cache.block_table(rid)], dim=1)
        assert torch.allclose(got, rows[:, : len(tokens) - 1], atol=1e-4), rid
        ref.release(rid)
