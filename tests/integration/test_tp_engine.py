"""A tensor-parallel engine (real rank processes, one gloo group) gives exactly the TP-1
engine's greedy tokens in float32, with chunked prefill, batched decode and prefix reuse,
on NemotronH with n_groups 4 (groups split) and n_groups 1 (B/C replicated, the gated norm
all-reduced), KV heads fewer than TP (replicated by division), and on Qwen3.5 (DeltaNet by
key / value heads, key heads replicated at TP 4, tied embeddings); canaries clean and the
mirrored cache operations identical on every rank.

Margins: the all-reduces sum partial products in another order than one matmul, so logits
move by ~1e-6. Prompts are kept only when every greedy step of the TP-1 model wins by at
least MARGIN; a differing token is reported with both candidates' logits and the margin.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from baton.cache import canary
from baton.contract.types import FinishReason
from baton.engine.request import Request
from baton.model.loader import load_model
from baton.worker.load import canary_audit
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all
from tests.support.tp_handoff import decode_from, prefill_dump, tp_of

SMALL = dict(pattern="M*M-M*", hidden_size=64, vocab_size=256, intermediate_size=128,
             mamba_head_dim=8, ssm_state_size=8, head_dim=16, chunk_size=16)
CONFIGS = {"groups4-kv2": dict(n_groups=4), "groups1-kv1": dict(n_groups=1,
                                                                  num_key_value_heads=1),
           "qwen3_5": {}}
# Qwen3.5: 2 key heads (replicated at TP 4), 4 value heads, 2 KV heads, tied embeddings
QWEN = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
            full_attention_interval=2, tie_word_embeddings=True)
WORKER = {"prefill_chunk_size": 16, "max_batch_tokens": 48}
LENGTHS = [1, 3, 7, 12, 17, 23, 31, 40, 47, 60]
STEPS = 8
MARGIN = 1e-3


@pytest.fixture(scope="module")
def env():
    mp = pytest.MonkeyPatch()
    mp.setenv("BATON_NUM_THREADS", "2")  # split between the ranks: same total threads
    mp.setenv(canary.ENV, "1")  # every rank's free blocks and slots hold canaries
    yield
    mp.undo()


CASES: dict[str, tuple] = {}
"""Computed once per session (test_tp_pp_engine shares them)."""


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def case(request, tmp_path_factory, env):
    """(model dir, kept prompts, follow-ups, TP-1 engine tokens of both, TP-1 greedy
    margins per prompt)."""
    if request.param not in CASES:
        CASES[request.param] = _case(request.param, tmp_path_factory)
    return CASES[request.param]


def _case(name: str, tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp(name)
    if name == "qwen3_5":
        from baton.model.qwen3_5.make import write_checkpoint

        path = write_checkpoint(root / "q", seed=5, **QWEN)
    else:
        path = make_checkpoint(root, seed=5, **SMALL, **CONFIGS[name])
    model = load_model(path)
    kept, margins = {}, {}
    for i, n in enumerate(LENGTHS):
        ids = prompt(i, n)
        toks, steps = greedy_margins(model, ids, STEPS)
        if min(m for _, _, m in steps) >= MARGIN:
            kept[f"r{i}"] = ids
            margins[f"r{i}"] = steps
    assert len(kept) >= 6, f"only {len(kept)} prompts clear the margin {MARGIN}"
    eng = engine_for(path, worker=WORKER)
    ref = run_all(eng, reqs(kept))["tokens"]
    follow = {f"{k}b": v + ref[k] + [7, 8, 9] for k, v in kept.items()}
    ref2 = run_all(eng, reqs(follow))["tokens"]
    return path, kept, follow, ref, ref2, margins


def reqs(prompts: dict) -> list[Request]:
    return [Request(k, list(v), greedy(STEPS)) for k, v in prompts.items()]


@torch.inference_mode()
def greedy_margins(model, ids, steps):
    """Greedy tokens of the TP-1 model by full recompute, and per step (top-1 token,
    top-2 token, logit margin)."""
    pools = model.make_pools(64, 16, 2)
    seq, out, info = list(ids), [], []
    for _ in range(steps):
        logits = model.prefill(torch.tensor(seq), 0, list(range(-(-len(seq) // 16))), 0, pools)
        top = torch.topk(logits, 2)
        info.append((int(top.indices[0]), int(top.indices[1]),
                     float(top.values[0] - top.values[1])))
        out.append(int(top.indices[0]))
        seq.append(out[-1])
    return out, info


def explain(got: dict, want: dict, margins: dict) -> str:
    """The first differing token of each request: position, tokens, the TP-1 margin."""
    lines = []
    for k, w in want.items():
        g = got.get(k, [])
        i = next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        if i is not None:
            m = margins.get(k)
            near = f"; TP-1 top-2 {m[i][:2]} margin {m[i][2]:.3g}" if m and i < len(m) else ""
            lines.append(f"{k} step {i}: got {g[i]}, want {w[i]}{near}")
    return "\n".join(lines)


TPS = (2, 4)


@pytest.fixture(scope="module", params=list(TPS), ids=["tp2", "tp4"])
def tp_engine(request, case):
    eng = engine_for(case[0], worker={**WORKER, "tensor_parallel_size": request.param})
    yield request.param, eng
    procs = eng.model.local_stages.procs
    try:
        eng.model.close()
    except Exception:  # noqa: BLE001 - the kill test broke the group; the ranks are gone
        pass
    assert all(p.poll() is not None for p in procs.values())


def test_tp_tokens_and_reuse_equal_tp1(tp_engine, case):
    tp, eng = tp_engine
    path, kept, follow, ref, ref2, margins = case
    got = run_all(eng, reqs(kept))["tokens"]
    assert got == ref, explain(got, ref, margins)
    res = run_all(eng, reqs(follow))
    assert res["tokens"] == ref2, explain(res["tokens"], ref2, {})
    assert sum(o.cached_tokens for o in res["outputs"].values()) > 0  # prefix reuse ran
    eng.cache.check_integrity()
    stats = eng.cache.stats()
    assert stats.slots_live == 0 and stats.blocks_free + stats.blocks_cached == stats.blocks_total
    audit = canary_audit(eng)  # free blocks and slots of every rank
    assert audit["canary_bad_blocks"] == 0 and audit["canary_bad_slots"] == 0
    assert audit["canary_blocks_checked"] > 0 and audit["canary_slots_checked"] > 0
    digests = eng.model.ops_digests()  # every rank applied rank 0's operations, in order
    assert len(digests) == tp and len(set(digests)) == 1


def test_tp_rank_pools_hold_their_shard(tp_engine, case):
    tp, eng = tp_engine
    cfg = eng.model.config
    local = eng.model.pools.local
    stats = eng.model.rank_stats()
    assert len(stats) == tp and all(s["collectives"] > 0 for s in stats)
    assert len({s["collectives"] for s in stats}) == 1  # lockstep: same count on every rank
    if cfg.family == "qwen3_5":
        hk = max(cfg.linear_num_key_heads // tp, 1)
        hv = cfg.linear_num_value_heads // tp
        assert local.kv.shape[-2] == max(cfg.num_key_value_heads // tp, 1)
        assert tuple(local.conv.shape[2:]) == (
            2 * hk * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim - 1)
        assert tuple(local.recurrent.shape[2:]) == (hv, cfg.linear_key_head_dim,
                                                    cfg.linear_value_head_dim)
        return
    kv_local = max(cfg.num_key_value_heads // tp, 1)
    g_local = max(cfg.n_groups // tp, 1)
    assert local.kv.shape[-2] == kv_local
    inner = cfg.mamba_intermediate // tp
    assert tuple(local.conv.shape[2:]) == (inner + 2 * g_local * cfg.ssm_state_size,
                                           cfg.conv_kernel - 1)
    assert tuple(local.ssm.shape[2:]) == (cfg.mamba_num_heads // tp, cfg.mamba_head_dim,
                                          cfg.ssm_state_size)


DUMPS: dict[tuple[str, int], dict] = {}
"""(model dir, prefill TP) -> that prefill's per-rank bytes of every kept prompt."""


def test_prefill_tp_to_decode_tp_handoff_equals_local(tp_engine, case):
    """Heterogeneous P/D through the TP plan (tests/support/tp_handoff.py): this engine's
    prefill bytes are kept; then every prefill kept so far (TP 1, and the TP sizes whose
    engines ran before) decodes on this engine, and at the largest TP also on a TP-1 engine:
    tokens equal the TP-1 local ones. A full run covers 1->2, 2->2, 1->4, 2->4, 4->4,
    1->1, 2->1, 4->1 (4->2 is covered by test_tp_expand's real pools)."""
    tp, eng = tp_engine
    path, kept, _, ref, _, margins = case
    key = str(path)
    if (key, 1) not in DUMPS:
        one = engine_for(path, worker=WORKER)
        DUMPS[key, 1] = prefill_dump(one, kept)
    DUMPS[key, tp] = prefill_dump(eng, kept)
    assert {rid: d[2] for rid, d in DUMPS[key, tp].items()} == {k: v[0] for k, v in ref.items()}
    targets = [eng] + ([engine_for(path, worker=WORKER)] if tp == max(TPS) else [])
    pairs = []
    for target in targets:
        for p in sorted(q for k, q in DUMPS if k == key):
            got = decode_from(target, eng.model.config, p, DUMPS[key, p], kept, STEPS)
            q = tp_of(target)
            assert got == ref, f"prefill TP {p} -> decode TP {q}:\n" + explain(got, ref,
                                                                               margins)
            pairs.append((p, q))
        target.cache.check_integrity()
    assert (1, tp) in pairs and (tp, tp) in pairs


def test_killed_rank_fails_the_forward_not_hangs(tp_engine):
    """Runs last on each engine: its last rank is killed; the next forward fails its
    requests at once (the broken group raises) and every rank process is gone."""
    tp, eng = tp_engine
    procs = eng.model.local_stages.procs
    os.kill(procs[tp - 1].pid, signal.SIGKILL)
    procs[tp - 1].wait(10)
    t0 = time.monotonic()
    out = run_all(eng, [Request("k", prompt(0, 5), greedy(3))])["outputs"]["k"]
    assert out.finish_reason == FinishReason.ERROR and time.monotonic() - t0 < 30
    deadline = time.monotonic() + 10  # the watcher took the other ranks down with it
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(p.poll() is not None for p in procs.values())
