"""On the fast path a verify pass runs plain decode's one-call layer program
(`fast_decode.verify_rows`: recurrent parts step position by position in C++) and every MTP
head pass its layers through the same program (`fast_decode.program_only`). Both must give
the bits of the module path they replace: every verify pass's hiddens and logits, every
draft and the tokens, for NemotronH (Mamba2, attention) and Qwen3.5 (DeltaNet, gated
attention), chains and a tree; and the program path must really be taken."""

from __future__ import annotations

import pytest
import torch

from baton.engine.request import Request
from baton.engine.speculative import decoder, drafter
from baton.model.layers import cpu_kernels, fast_decode, step_kernels
from tests.support.engine_helpers import engine_for, greedy, prompt, run_all
from tests.support.speculative_helpers import agreeing_checkpoint, agreeing_qwen_checkpoint

pytestmark = [pytest.mark.usefixtures("model_single_thread"),
              pytest.mark.skipif(cpu_kernels.gemv() is None or step_kernels.kernels() is None,
                                 reason="kernels not built")]

TREE = {"top_k": [2, 2, 1], "max_total_draft_tokens": 6}


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5"])
def agree_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"verify_program_{request.param}")
    make = agreeing_checkpoint if request.param == "nemotron_h" else agreeing_qwen_checkpoint
    return make(root)


def _run(model_dir, tree: bool, monkeypatch, program: bool) -> dict:
    """Four greedy requests (prompts of 5..70 tokens, 3 to 14 new tokens, concurrency 3) at
    K = 3 or a tree; each verify pass's (hidden, logits), the drafts and the tokens, with the
    programs on or (`program` False) replaced by the modules."""
    seen = {"verify": [], "drafts": [], "verify_rows": 0, "program_only": 0}
    for name in ("verify_rows", "program_only"):
        real = getattr(fast_decode, name)

        def counted(*args, _real=real, _name=name):
            out = _real(*args) if program else None
            seen[_name] += out is not None
            return out

        monkeypatch.setattr(fast_decode, name, counted)
    real_verify = decoder.verify_forward

    def verify(*args, **kw):
        hidden, logits = real_verify(*args, **kw)
        seen["verify"].append((hidden.clone(), logits.clone()))
        return hidden, logits

    monkeypatch.setattr(decoder, "verify_forward", verify)
    for name in ("draft", "draft_tree"):
        real = getattr(drafter.Drafter, name)

        def drafted(self, *args, _real=real):
            out = _real(self, *args)
            seen["drafts"].append(repr(out))
            return out

        monkeypatch.setattr(drafter.Drafter, name, drafted)
    spec, cache = {"num_draft_tokens": 3}, {}
    if tree:
        spec, cache = {"num_draft_tokens": 3, "tree": TREE}, {"num_state_slots": 64}
    eng = engine_for(model_dir, worker={"max_num_seqs": 3}, speculative=spec, cache=cache)
    reqs = [Request(f"r{i}", prompt(i, n), greedy(m))
            for i, (n, m) in enumerate([(5, 14), (70, 3), (17, 9), (33, 12)])]
    seen["tokens"] = run_all(eng, reqs)["tokens"]
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_programs_give_the_module_paths_bits(agree_dir, tree, monkeypatch):
    on = _run(agree_dir, tree, monkeypatch, program=True)
    off = _run(agree_dir, tree, monkeypatch, program=False)
    assert on["verify_rows"] == len(on["verify"]) > 0  # every verify pass took the program
    assert on["program_only"] > 0 and off["verify_rows"] == off["program_only"] == 0
    assert on["tokens"] == off["tokens"]
    assert on["drafts"] == off["drafts"]
    assert len(on["verify"]) == len(off["verify"])
    for (h1, l1), (h2, l2) in zip(on["verify"], off["verify"], strict=True):
        assert torch.equal(h1, h2) and torch.equal(l1, l2)
