"""A seeded request sampled at temperature > 0 gives the same tokens with speculation off, on
(drafting every step) and on under the default `speculative.max_batch` rule (drafting or not
by batch size), at concurrency 1, 3 and 8: the target's token at a position is its own
(seed, position) draw, drafted or not (baton/engine/speculative/rejection.py)."""

from __future__ import annotations

import pytest

from baton.config.speculative import SpeculativeConfig
from baton.engine.request import Request, SamplingParams
from tests.support.engine_helpers import engine_for, prompt, run_all
from tests.support.speculative_helpers import agreeing_checkpoint, agreeing_qwen_checkpoint
from tests.support.trained import NAMES, shipped

pytestmark = pytest.mark.usefixtures("model_single_thread")

SPEC = {
    "off": None,
    "on": {"num_draft_tokens": 3, "max_batch": 0},
    "default rule": {"num_draft_tokens": 3, "max_batch": SpeculativeConfig.max_batch},
}


def _requests() -> list[Request]:
    """8 seeded requests, prompts of 3-24 tokens, 12-30 tokens each; two with top-k / top-p."""
    out = []
    for i in range(8):
        extra = {2: {"top_k": 5}, 5: {"top_p": 0.8}}.get(i, {})
        params = SamplingParams(max_tokens=12 + 3 * (i % 7), temperature=0.8, seed=100 + i,
                                ignore_eos=True, **extra)
        out.append(Request(f"s{i}", prompt(i, 3 + 3 * i), params))
    return out


def _run(ck, spec: dict | None, concurrency: int):
    sections = {"worker": {"max_num_seqs": concurrency}}
    if spec is not None:
        sections["speculative"] = spec
    eng = engine_for(ck, **sections)
    toks = run_all(eng, _requests())["tokens"]
    return toks, eng.spec


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5", *NAMES])
def checkpoint(request, tmp_path_factory):
    """The agreeing tiny models, and the trained ones where they are shipped."""
    if request.param in NAMES:
        return shipped(request.param)
    root = tmp_path_factory.mktemp("seeded")
    return agreeing_checkpoint(root) if request.param == "nemotron_h" \
        else agreeing_qwen_checkpoint(root)


def test_seeded_sampling_independent_of_drafting_and_batch(checkpoint):
    ref, _ = _run(checkpoint, None, 1)
    assert all(len(t) == r.sampling.max_tokens for t, r in zip(ref.values(), _requests(), strict=True))
    for name, spec in SPEC.items():
        for c in (1, 3, 8):
            if name == "off" and c == 1:
                continue
            toks, s = _run(checkpoint, spec, c)
            assert toks == ref, (name, c)
            if s is not None and (name == "on" or c <= 2):
                # drafts were checked, some kept, some not
                assert s.accepted_tokens > 0 and s.draft_tokens > s.accepted_tokens, (name, c)
