"""MoE models under local tensor parallelism (real rank processes, one gloo group) give
exactly the TP-1 engine's greedy tokens in float32, and logprobs within 1e-4, on NemotronH
MoE (published one-tensor-per-expert layout, latent projections, group top-k routing,
non-zero biases on the shared expert and latent projections) and Qwen3.5-MoE (fused
experts, shared expert and its gate): whole experts per rank at TP 2 and TP 4 (the
default), and split within each expert under TP 2 x PP 2 (test_tp_pp_moe_engine); one
all-reduce per MoE layer;
chunked prefill and batched decode; canaries clean (prefix reuse under TP: test_tp_engine;
MoE layers hold no cache).

Margin-filtered prompts as in test_tp_engine: a differing token is reported with both TP-1
candidates and their margin, a logprob that moved with its size.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.engine.request import Request
from baton.model.loader import load_model
from baton.worker.load import canary_audit
from tests.integration.test_tp_engine import (  # noqa: F401
    MARGIN,
    STEPS,
    WORKER,
    env,
    explain,
    greedy_margins,
)
from tests.support.engine_helpers import engine_for, greedy, prompt

NH = dict(pattern="ME*E-E", hidden_size=64, vocab_size=256, intermediate_size=128,
          mamba_head_dim=8, ssm_state_size=8, head_dim=16, chunk_size=16, n_groups=4,
          moe_latent_size=32, n_group=4, topk_group=2, mlp_bias=True)
QWEN = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
            full_attention_interval=2, tie_word_embeddings=True)
LENGTHS = [1, 5, 12, 19, 33, 47]
LOGPROBS = 3
TOL = 1e-4
"""Largest logprob difference allowed: the reduce order moves fp32 logits by ~1e-6."""
ENGINES = [("nemotron_h", "experts", 2), ("nemotron_h", "experts", 4),
           ("qwen3_5_moe", "experts", 2), ("qwen3_5_moe", "experts", 4)]
"""(family, worker.moe_tp_split, TP): the default at TP 2 and 4 on both families; `within`
end to end under TP x PP (test_tp_pp_moe_engine; both splits on both families layer by
layer: test_tp_moe_shards)."""


def _write(name: str, root):
    if name == "qwen3_5_moe":
        from baton.model.qwen3_5.moe_make import write_checkpoint

        return write_checkpoint(root / "q", seed=4, **QWEN)
    from baton.model.make_model import write_checkpoint

    path = write_checkpoint(root / "nh", seed=4, **NH)
    file = path / "model.safetensors"
    state, gen = load_file(str(file)), torch.Generator().manual_seed(5)
    for k in [k for k in state if k.endswith(".bias") and "conv1d" not in k]:
        state[k] = torch.randn(state[k].shape, generator=gen) * 0.1  # added once after a reduce
    save_file(state, str(file), metadata={"format": "pt"})
    return path


CASES: dict[str, tuple] = {}


def _case(family: str, tmp_path_factory) -> tuple:
    """(model dir, kept prompts, TP-1 engine results, TP-1 greedy margins), once."""
    if family not in CASES:
        path = _write(family, tmp_path_factory.mktemp(family))
        model = load_model(path)
        kept, margins = {}, {}
        for i, n in enumerate(LENGTHS):
            ids = prompt(100 + i, n)
            _, steps = greedy_margins(model, ids, STEPS)
            if min(m for _, _, m in steps) >= MARGIN:
                kept[f"r{i}"], margins[f"r{i}"] = ids, steps
        assert len(kept) >= 4, f"only {len(kept)} prompts clear the margin {MARGIN}"
        ref = run(engine_for(path, worker=WORKER), kept)
        assert sum(ref.pop("cached")) == 0
        CASES[family] = (path, kept, ref, margins)
    return CASES[family]


def run(eng, prompts: dict, steps: int = STEPS) -> dict[str, tuple[list[int], list]]:
    """request id -> (tokens, logprobs of each token); "cached": prompt tokens reused."""
    out = {k: ([], []) for k in prompts}
    out["cached"] = []
    for k, ids in prompts.items():
        eng.add_request(Request(k, list(ids), greedy(steps, logprobs=LOGPROBS)))
    done = 0
    while done < len(prompts):
        for o in eng.step():
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.logprobs)
            if o.finished:
                done += 1
                out["cached"].append(o.cached_tokens)
    return out


def logprob_gaps(got: dict, want: dict) -> list[str]:
    """Every chosen and top-k logprob that moved by more than TOL, named."""
    bad = []
    for k, (_, w) in want.items():
        for i, (a, b) in enumerate(zip(got[k][1], w, strict=True)):
            pairs = [(a.token_id, a.logprob, b.logprob)] + [
                (ta, la, lb) for (ta, la), (_, lb) in zip(a.top, b.top, strict=True)]
            bad += [f"{k} step {i} token {t}: {x:.7f} vs TP-1 {y:.7f} ({abs(x - y):.2g})"
                    for t, x, y in pairs if abs(x - y) > TOL]
    return bad


@pytest.fixture(scope="module", params=ENGINES, ids=["-".join(map(str, e)) for e in ENGINES])
def tp_engine(request, tmp_path_factory, env):  # noqa: F811
    family, split, tp = request.param
    case = _case(family, tmp_path_factory)
    eng = engine_for(case[0], worker={**WORKER, "tensor_parallel_size": tp,
                                      "moe_tp_split": split})
    procs = eng.model.local_stages.procs
    yield tp, eng, case
    eng.model.close()
    assert all(p.poll() is not None for p in procs.values())


def test_moe_tp_tokens_and_logprobs_equal_tp1(tp_engine):
    tp, eng, (path, kept, ref, margins) = tp_engine
    got = run(eng, kept)
    got.pop("cached")
    toks, want = {k: v[0] for k, v in got.items()}, {k: v[0] for k, v in ref.items()}
    assert toks == want, explain(toks, want, margins)
    assert all(len(got[k][1]) == STEPS for k in kept)
    assert logprob_gaps(got, ref) == []
    eng.cache.check_integrity()
    audit = canary_audit(eng)
    assert audit["canary_bad_blocks"] == 0 and audit["canary_bad_slots"] == 0
    assert audit["canary_blocks_checked"] > 0
    stats = eng.model.rank_stats()  # lockstep: the same collectives on every rank
    assert len(stats) == tp and len({s["collectives"] for s in stats}) == 1


def test_one_all_reduce_per_moe_layer(tp_engine):
    """Two more decode steps cost two forwards, each one all-reduce per sublayer
    (NemotronH: each layer, MoE included; Qwen: the mixer and the MoE feed-forward) plus
    the embedding's and the LM head's collectives."""
    tp, eng, _ = tp_engine
    cfg = eng.model.config
    per_layer = 2 if cfg.family == "qwen3_5_moe" else 1
    counts = []
    for steps in (3, 5):
        before = eng.model.rank_stats()[0]["collectives"]
        run(eng, {"one": prompt(7, 1)}, steps)
        counts.append(eng.model.rank_stats()[0]["collectives"] - before)
    assert counts[1] - counts[0] == 2 * (per_layer * cfg.num_layers + 2)

