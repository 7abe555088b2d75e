"""`bench engine` MoE rows: Baton's model forward vs transformers' on one MoE NemotronH and
its dense twin (same pattern with `-` where the MoE has `E`), same threads, side by side.

Two phases: decode of one token for each of 32 sequences (after a short prompt), and a
prefill of 2048 tokens. Besides tokens/s each row gives the active parameters per token and
their product (`active_gparam_tok_s`: parameter-tokens per second, equal for the two models
when routing costs nothing), so the price of routing is visible.
"""

from __future__ import annotations

import sys
import time

import torch

from bench.common import cache_dir

DENSE = "M-M*M-M-M*M-M-M*M-"
MOE = DENSE.replace("-", "E")
SHAPE = dict(preset="100m", seed=1, n_routed_experts=32, num_experts_per_tok=4,
             moe_intermediate_size=512, moe_shared_expert_intermediate_size=1024)


def checkpoints(quick: bool) -> dict[str, object]:
    from baton.model.make_model import write_checkpoint

    pattern = (DENSE[:6], MOE[:6]) if quick else (DENSE, MOE)
    out = {}
    for name, pat in zip(("dense", "moe"), pattern, strict=True):
        path = cache_dir() / f"bench-{name}-{len(pat)}-v1"
        if not (path / "config.json").is_file():
            write_checkpoint(path, pattern=pat, **SHAPE)
        out[name] = path
    return out


def active_params(model) -> int:
    """Parameters one token touches: all but the unchosen experts and the embedding table."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters()) - cfg.vocab_size * cfg.hidden_size
    for i in cfg.moe_layers:
        ex = model.backbone.layers[i].mixer.experts
        per_expert = (ex.up_proj.numel() + ex.down_proj.numel()) // cfg.n_routed_experts
        total -= per_expert * (cfg.n_routed_experts - cfg.num_experts_per_tok)
    return total


def _baton_steps(model, batch: int, prompt: int, prefill: int):
    """(one decode step of `batch` sequences, one prefill of `prefill` tokens) closures."""
    tpb, room = 16, 64
    per = -(-(prompt + room) // tpb)
    pools = model.make_pools(batch * per + prefill // tpb + 1, tpb, batch + 1)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    ids = torch.randint(3, 1000, (batch, prompt))
    model.prefill_batch(ids, [0] * batch, tables, list(range(batch)), pools)
    pos, slots = torch.full((batch,), prompt), torch.arange(batch)
    tok = torch.randint(3, 1000, (batch,))
    long_ids = torch.randint(3, 1000, (prefill,))
    long_table = list(range(batch * per, batch * per + prefill // tpb + 1))
    # the same position each step: the state moves on, the cost does not
    return (lambda: model.decode(tok, pos, tables, slots, pools),
            lambda: model.prefill(long_ids, 0, long_table, batch, pools))


def _hf_steps(path, batch: int, prompt: int, prefill: int):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(3, 1000, (batch, prompt))
    with torch.inference_mode():
        cache = hf(ids, use_cache=True).past_key_values
    tok = torch.randint(3, 1000, (batch, 1))
    long_ids = torch.randint(3, 1000, (1, prefill))

    def decode():
        with torch.inference_mode():
            hf(tok, past_key_values=cache, use_cache=True)

    def pre():
        with torch.inference_mode():
            hf(long_ids, use_cache=False)

    return decode, pre


def _best_interleaved(fns: dict, reps: int) -> dict[str, float]:
    """Best time of each closure over `reps` rounds, the closures alternating within a round
    (so a neighbour's load on the shared box hits both sides alike)."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def run_rows(quick: bool) -> list[dict]:
    from baton.model.loader import load_model

    batch, prompt = 32, 32
    prefill, reps = (256, 2) if quick else (2048, 4)
    rows = []
    for name, path in checkpoints(quick).items():
        model = load_model(path)
        active = active_params(model)
        b_dec, b_pre = _baton_steps(model, batch, prompt, prefill)
        h_dec, h_pre = _hf_steps(path, batch, prompt, prefill)
        dec = _best_interleaved({"baton": b_dec, "hf": h_dec}, 2 * reps)
        pre = _best_interleaved({"baton": b_pre, "hf": h_pre}, reps)
        b_dec, h_dec, b_pre, h_pre = dec["baton"], dec["hf"], pre["baton"], pre["hf"]
        for phase, tokens, b, h in (("decode-b32", batch, b_dec, h_dec),
                                    (f"prefill-{prefill}", prefill, b_pre, h_pre)):
            row = {
                "benchmark": "engine", "label": f"{name}-{phase}", "model": name,
                "phase": phase, "threads": torch.get_num_threads(),
                "active_params_m": round(active / 1e6, 2),
                "baton_tok_s": round(tokens / b, 1), "hf_tok_s": round(tokens / h, 1),
                "ratio": round(h / b, 2), "target_ratio": 2.0,
                "active_gparam_tok_s": round(tokens / b * active / 1e9, 2),
            }
            print(f"[bench engine] {row}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


LOAD_SCRIPT = """
import json, sys, time
from pathlib import Path
from baton.model.loader import checkpoint_files, load_model

def status():
    out = {}
    for line in open("/proc/self/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) * 1024
    return out

path = Path(sys.argv[1])
size = sum(f.stat().st_size for f in checkpoint_files(path))
start = status()["VmRSS"]
t0 = time.perf_counter()
load_model(path)
print(json.dumps({"bytes": size, "start": start, "peak": status()["VmHWM"],
                  "seconds": time.perf_counter() - t0}))
"""


def load_rss_row(quick: bool) -> dict:
    """Peak RSS of a fresh process loading a per-expert (published layout) checkpoint of a
    few GB, against the checkpoint's bytes (target: at most 1.2x)."""
    import json
    import os
    import subprocess

    from baton.model.make_model import write_checkpoint

    shape = dict(preset="tiny", n_routed_experts=16) if quick else \
        dict(preset="100m", n_routed_experts=64, num_experts_per_tok=6)
    path = cache_dir() / f"bench-moe-load-{shape['preset']}-v1"
    if not (path / "config.json").is_file():
        write_checkpoint(path, pattern="MEM*E-MEME", seed=2, **shape)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(path)], env=env, check=True,
                         capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    row = {"benchmark": "engine", "label": "moe-load-rss", "checkpoint_gb": round(r["bytes"] / 1e9, 3),
           "peak_rss_gb": round(r["peak"] / 1e9, 3),
           "peak_ratio": round(r["peak"] / r["bytes"], 3),
           "peak_over_start_ratio": round((r["peak"] - r["start"]) / r["bytes"], 3),
           "load_s": round(r["seconds"], 1), "target_ratio": 1.2}
    print(f"[bench engine] {row}", file=sys.stderr, flush=True)
    return row
