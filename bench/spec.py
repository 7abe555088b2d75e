"""`baton bench spec`: MTP speculative decoding against speculation off, colocated and through
a 1P+1D cluster.

First the checkpoint's MTP head is fitted to what its target computes (bench/spec_distill.py:
fixed seeds, bounded wall time: 6 minutes for the 100m, 1.5 for the tiny; saved in the
published names), then
at 1, 8 and 32 concurrent requests, side by side in one run (off measured before and after
the speculative runs, and averaged, so load drift shows in `off_drift`):

    colocated   K = 0 (off), 1, 2, 3, a tree (TREE), and K = 3 with the compute-bound rule
                (`speculative.max_batch` = MAX_BATCH: no drafts while more requests decode)
    cluster     off and K = 3, one prefill and one decode worker (bench/spec_cluster.py)

`--model NAME_OR_DIR` (e.g. `code-nemotron_h`) measures a trained checkpoint with its own
trained head instead: no distillation, prompts of 96 tokens from the committed held-out text,
and off and the variants alternating in turn, ROUNDS times (--quick: once, 32-token prompts),
the rates over all rounds.

Each row: decode tokens/s, the mean accepted length (tokens emitted per request per
speculative step: 1 + accepted drafts), whether the tokens equal speculation off, where a
speculative step's time goes (MTP passes, the verify forward, acceptance and roll back, in
ms per step, beside a plain decode step) and the memory a request holds for speculation.
`cpu_speedup` compares decode tokens per CPU second of the process (one torch thread unless
BATON_NUM_THREADS is set: the engine's one thread): on a machine shared with other work,
wall-clock ratios drift with the load, CPU seconds much less.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.common import cache_dir, prompts

TARGETS = {"accepted_length_at_k3": 2.0, "speedup_at_batch1": 1.6, "min_ratio_at_batch32": 1.0}
TREE = {"top_k": [2, 2, 1], "max_total_draft_tokens": 6}
MAX_BATCH = 2
"""`speculative.max_batch` of the rule rows (its default): no drafts above 2 requests."""


def _checkpoint(preset: str) -> Path:
    from baton.model.make_model import write_checkpoint

    path = cache_dir() / f"bench-{preset}-mtp-v2"
    if not (path / "config.json").is_file():
        write_checkpoint(path, preset=preset, seed=1, mtp_layers=1)
    return path


def spec_section(variant) -> dict:
    """The `speculative` config of a row's variant: 0 (off), K, "tree" or "rule"."""
    if variant == "tree":
        return {"num_draft_tokens": len(TREE["top_k"]), "tree": TREE, "max_batch": 0}
    if variant == "rule":
        return {"num_draft_tokens": 3, "max_batch": MAX_BATCH}
    return {"num_draft_tokens": variant, "max_batch": 0}


def rows_per_request(variant) -> int:
    if variant == "tree":
        return TREE["max_total_draft_tokens"]
    return 3 if variant == "rule" else variant


def config(n: int, total: int, variant) -> dict:
    return {
        "cache": {"enable_prefix_reuse": False, "num_blocks": n * (total // 16 + 2) + 16,
                  "num_state_slots": n * (1 + rows_per_request(variant)) + 1},
        "worker": {"max_num_seqs": n, "max_batch_tokens": 4096, "prefill_chunk_size": 2048,
                   "max_model_len": total + 1},
        "speculative": spec_section(variant),
    }


def _run(path: Path, reqs: list[list[int]], out_len: int, variant):
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine
    from baton.engine.request import Request, SamplingParams

    n = len(reqs)
    eng = build_engine(BatonConfig.from_dict(config(n, len(reqs[0]) + out_len, variant)),
                       str(path))
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(reqs):
        eng.add_request(Request(f"b{i}", p, sp))
    out = {f"b{i}": [] for i in range(n)}
    t_first, steps, prompts_done, base = None, 0, False, 0
    while eng.has_work:
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
        if t_first is None and prompts_done:
            # every prompt done and one decode step run: that step paid the one-off set up
            # of the decode kernels (weights packed or transposed once per model, compiled
            # steps), seconds that are no decode speed; the clock starts after it
            t_first, c_first = time.perf_counter(), time.process_time()
            base = sum(len(v) for v in out.values())
            if eng.spec is not None:
                eng.spec.seconds = dict.fromkeys(eng.spec.seconds, 0.0)
                eng.spec.steps = 0
        elif t_first is not None:
            steps += 1
        prompts_done = prompts_done or all(out.values())
    dt, cpu = time.perf_counter() - t_first, time.process_time() - c_first
    decoded = sum(len(v) for v in out.values()) - base
    return {"tok_s": decoded / dt, "cpu_tok_s": decoded / cpu, "out": out, "eng": eng,
            "step_ms": 1000 * dt / max(1, steps)}


def _accepted_length(eng) -> float | None:
    if eng.spec is None:
        return None
    steps = sum(eng.spec.accepted_hist)
    return round(1 + eng.spec.accepted_tokens / steps, 2) if steps else 1.0


def _row(preset: str, conc: int, variant, r: dict, base: dict, drift: float, ref, summary):
    eng = r["eng"]
    spec = eng.spec
    rows = rows_per_request(variant)
    head_kv = 0
    if spec is not None and spec.draft_layers:  # the head's KV per token, beside the target's
        ps = eng.pools.spec
        head_kv = len(spec.draft_layers) * 2 * ps.num_kv_heads * ps.head_dim * \
            eng.pools.kv.element_size()
    row = {
        "benchmark": "spec", "label": f"{preset}-c{conc}-{variant}", "model": preset,
        "where": "colocated", "concurrency": conc, "variant": str(variant),
        "off_decode_tok_s": round(base["tok_s"], 1), "off_drift": round(drift, 3),
        "spec_decode_tok_s": round(r["tok_s"], 1), "speedup": round(r["tok_s"] / base["tok_s"], 2),
        # per CPU second of this process: what a shared, loaded machine cannot skew
        "cpu_speedup": round(r["cpu_tok_s"] / base["cpu_tok_s"], 2),
        "accepted_length": _accepted_length(eng),
        "identical_to_off": all(o == ref for o in r.get("outs", [r["out"]])),
        "state_slots_per_request": 1 + rows,
        "spec_state_bytes_per_request": rows * eng.pools.spec.state_bytes_per_slot(),
        "mtp_kv_bytes_per_token": head_kv, "distill_steps": summary["steps"],
    }
    if spec is not None and spec.steps:
        row.update({f"{k}_ms_per_step": round(1000 * v / spec.steps, 2)
                    for k, v in spec.seconds.items()})
    return row


def run(args) -> list[dict]:
    """Measured on the optimised decode path (`BATON_DECODE_PATH=fast`, its workers too):
    the verify pass runs marked as decode, so it rounds as plain decode does there. One torch
    thread per engine unless BATON_NUM_THREADS says otherwise: `cpu_speedup` is then the
    engine thread's work (with two, a pass of few rows also pays the second thread's fork
    and join on every kernel call)."""
    import os

    import torch

    from baton.model.layers.linear import set_decode_path

    saved = {k: os.environ.get(k) for k in ("BATON_DECODE_PATH", "BATON_NUM_THREADS")}
    os.environ["BATON_DECODE_PATH"] = "fast"  # the cluster's workers inherit it
    os.environ.setdefault("BATON_NUM_THREADS", "1")
    old, threads = set_decode_path("fast"), torch.get_num_threads()
    try:
        return _run_all(args)
    finally:
        set_decode_path(old)
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_all(args) -> list[dict]:
    import json

    from bench.spec_cluster import cluster_rows
    from bench.spec_distill import distill

    quick = getattr(args, "quick", False)
    model = getattr(args, "model", None)
    if model:  # a trained checkpoint: its own head, held-out prompts, no distillation
        from baton.model.registry import resolve_model

        path = Path(resolve_model(model))
        preset, summary = path.name, {"steps": 0}
        rounds = 1 if quick else ROUNDS
    else:
        preset = "tiny" if quick else "100m"
        path = _checkpoint(preset)
        # the tiny head gains from tuning on continuations, the 100m's from data
        # (spec_distill.py)
        summary = distill(path, seconds=90, greedy=48) if quick else \
            distill(path, seconds=360, greedy=4, data_share=0.85)
        print(f"[bench spec] distilled {preset}: {summary}", file=sys.stderr, flush=True)
        rounds = 1
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompt_len, out_len = (32, 32) if quick else ((96, 64) if model else (32, 64))
    make_prompts = (lambda n, length, seed: heldout_prompts(path, n, length, seed)) if model \
        else (lambda n, length, seed: prompts(n, length, vocab, seed=seed))
    _run(path, make_prompts(1, 16, 0), 4, 1)  # first calls pay one-off setup
    rows, refs = [], {}
    for conc in (1, 8, 32):
        reqs = make_prompts(conc, prompt_len, 100 + conc)
        runs, offs = _alternating(path, reqs, out_len, rounds)
        before, after = offs[0], offs[-1]
        base = {k: sum(o[k] for o in offs[:-1]) / max(1, len(offs) - 1) if rounds > 1
                else (before[k] + after[k]) / 2 for k in ("tok_s", "cpu_tok_s")}
        drift = after["tok_s"] / before["tok_s"] - 1
        refs[conc] = (reqs, before["out"])
        for v, r in runs.items():
            row = _row(preset, conc, v, r, base, drift, before["out"], summary)
            row["off_step_ms"] = round(sum(o["step_ms"] for o in offs) / len(offs), 2)
            row["rounds"] = rounds
            print(f"[bench spec] {row}", file=sys.stderr, flush=True)
            rows.append(row)
    for row in cluster_rows(path, preset, refs, out_len):
        print(f"[bench spec] {row}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


ROUNDS = 2
"""Rounds of a trained model's rows (--model): off and every variant in turn, each round."""
VARIANTS = (1, 2, 3, "tree", "rule")


def _alternating(path: Path, reqs, out_len: int, rounds: int):
    """Off, then each variant, `rounds` times in turn, and off once more: the variants'
    rates summed over the rounds (decode tokens over seconds and over CPU seconds), and every
    off run (the first one's tokens are the reference)."""
    runs, offs = {}, []
    for _ in range(rounds):
        offs.append(_run(path, reqs, out_len, 0))
        for v in VARIANTS:
            r = _run(path, reqs, out_len, v)
            if v in runs:  # rates over both rounds: tokens / (time of both)
                a = runs[v]
                for k in ("tok_s", "cpu_tok_s"):
                    r[k] = 2 / (1 / a[k] + 1 / r[k])
                r["eng"] = _merged(a["eng"], r["eng"])
                r["outs"] = a["outs"] + [r["out"]]
            else:
                r["outs"] = [r["out"]]
            runs[v] = r
    offs.append(_run(path, reqs, out_len, 0))
    return runs, offs


def _merged(a, b):
    """The later engine, its speculation counts summed with the earlier one's."""
    if a.spec is not None and b.spec is not None:
        b.spec.accepted_tokens += a.spec.accepted_tokens
        b.spec.draft_tokens += a.spec.draft_tokens
        b.spec.accepted_hist = [x + y for x, y in zip(a.spec.accepted_hist,
                                                       b.spec.accepted_hist, strict=True)]
        b.spec.seconds = {k: v + a.spec.seconds[k] for k, v in b.spec.seconds.items()}
        b.spec.steps += a.spec.steps
    return b


def heldout_prompts(path: Path, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` tokens from the committed held-out text (the model's tokenizer),
    at offsets drawn from `seed`."""
    import random

    from baton.model.tokenizer import load_tokenizer
    from baton.train.corpus import heldout

    tok = load_tokenizer(path)
    ids = [t for d in heldout() for t in tok.encode(d.text)]
    rng = random.Random(seed)
    return [ids[s : s + length] for s in (rng.randrange(len(ids) - length) for _ in range(n))]
