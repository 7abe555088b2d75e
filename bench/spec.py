"""`baton bench spec`: MTP speculative decoding against speculation off, colocated.

First the checkpoint's MTP head is distilled on the target's own greedy continuations
(bench/spec_distill.py: fixed seed, bounded wall time, saved in the published names), then
for K = 0 (off), 1, 2, 3 at 1, 8 and 32 concurrent requests: decode tokens/s, the mean
accepted length (tokens emitted per request per speculative step: 1 + accepted drafts) and
whether the tokens equal speculation off. Not measured here: through the cluster, trees.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.common import cache_dir, prompts

TARGETS = {"accepted_length_at_k3": 2.0, "speedup_at_batch1": 1.6, "min_ratio_at_batch32": 1.0}


def _checkpoint(preset: str) -> Path:
    from baton.model.make_model import write_checkpoint

    path = cache_dir() / f"bench-{preset}-mtp-v1"
    if not (path / "config.json").is_file():
        write_checkpoint(path, preset=preset, seed=1, mtp_layers=1)
    return path


def _run(path: Path, reqs: list[list[int]], out_len: int, k: int):
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine
    from baton.engine.request import Request, SamplingParams

    n = len(reqs)
    total = len(reqs[0]) + out_len
    cfg = BatonConfig.from_dict({
        "cache": {"enable_prefix_reuse": False, "num_blocks": n * (total // 16 + 2) + 16,
                  "num_state_slots": n * (1 + k) + 1},
        "worker": {"max_num_seqs": n, "max_batch_tokens": 4096, "prefill_chunk_size": 2048,
                   "max_model_len": total + 1},
        "speculative": {"num_draft_tokens": k},
    })
    eng = build_engine(cfg, str(path))
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(reqs):
        eng.add_request(Request(f"b{i}", p, sp))
    out = {f"b{i}": [] for i in range(n)}
    t_first = None
    while eng.has_work:
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
        if t_first is None and all(out.values()):
            t_first = time.perf_counter()  # every prompt done: decoding from here on
    dt = time.perf_counter() - t_first
    decoded = sum(len(v) - 1 for v in out.values())
    al = None
    if eng.spec is not None:
        steps = sum(eng.spec.accepted_hist)
        al = 1 + eng.spec.accepted_tokens / steps if steps else 1.0
    return decoded / dt, al, out, eng


def run(args) -> list[dict]:
    from bench.spec_distill import distill

    quick = getattr(args, "quick", False)
    preset = "tiny" if quick else "100m"
    path = _checkpoint(preset)
    summary = distill(path, seconds=20 if quick else 180)
    print(f"[bench spec] distilled {preset}: {summary}", file=sys.stderr, flush=True)
    import json

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompt_len, out_len = 32, (32 if quick else 96)
    _run(path, prompts(1, 16, vocab), 4, 1)  # first calls pay one-off setup
    rows = []
    for conc in (1, 8, 32):
        reqs = prompts(conc, prompt_len, vocab, seed=100 + conc)
        base, _, ref, _ = _run(path, reqs, out_len, 0)
        for k in (1, 2, 3):
            tok_s, al, out, eng = _run(path, reqs, out_len, k)
            row = {
                "benchmark": "spec", "label": f"{preset}-c{conc}-k{k}", "model": preset,
                "concurrency": conc, "k": k, "output_tokens": out_len,
                "off_decode_tok_s": round(base, 1), "spec_decode_tok_s": round(tok_s, 1),
                "speedup": round(tok_s / base, 2), "accepted_length": round(al, 2),
                "identical_to_off": out == ref,
                "state_slots_per_request": 1 + k,
                "spec_state_bytes_per_request": k * eng.pools.spec.state_bytes_per_slot(),
                "distill_steps": summary["steps"],
            }
            print(f"[bench spec] {row}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows
