"""`baton bench pp`: pipeline-parallel prefill with PP 1, 2, 3 stage processes (one torch
thread each): prefill throughput and TTFT for a full batch of 4k-token prompts, stage
utilisation (busy / wall) per stage, and the bytes one 4k-token handoff moves per
(prefill stage, decode stage) pair, from the transfer planner over each split's layouts.

Stage 0 counts its own busy time; the other stages report theirs over the control channel.
On a 2-core host, two stages overlap only through micro-batches; PP 3 oversubscribes.
"""

from __future__ import annotations

import os
import sys
import time

from bench.common import checkpoint, prompts

SIZES = (1, 2, 3)


def _engine(path, pp: int, n: int, prompt_len: int, chunk: int):
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine

    blocks = n * (prompt_len // 16 + 2) + 16
    cfg = BatonConfig.from_dict({
        "cache": {"enable_prefix_reuse": False, "num_blocks": blocks, "num_state_slots": n + 1},
        "worker": {"max_num_seqs": n, "max_batch_tokens": n * chunk, "prefill_chunk_size": chunk,
                   "max_model_len": prompt_len + 8, "pipeline_parallel_size": pp},
    })
    return build_engine(cfg, str(path))


def _busy(engine) -> list[float]:
    model = engine.model
    if not hasattr(model, "call"):
        return []
    return [model.busy_s] + [r["busy_s"] for r in model.call("stats", lambda k: {})]


def _cpu(engine) -> list[float]:
    """CPU seconds of every stage process (stage 0 is this one): on a loaded host, wall-clock
    busy time also counts time a stage waited for a core."""
    from bench.common import cpu_seconds

    stages = getattr(engine.model, "local_stages", None)
    pids = [os.getpid(), *(stages.pids().values() if stages is not None else [])]
    return [cpu_seconds(p) for p in pids]


def _prefill(engine, reqs: list[list[int]], tag: str) -> tuple[float, list[float]]:
    """Wall seconds until every prompt has its first token, and each request's TTFT (ms)."""
    from baton.engine.request import Request, SamplingParams

    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(reqs):
        engine.add_request(Request(f"{tag}{i}", p, sp, prefill_only=True))
    ttft, done = [], 0
    while done < len(reqs):
        for out in engine.step():
            if out.finished:
                done += 1
                ttft.append(out.ttft_ms)
                engine.release(out.request_id)
    return time.perf_counter() - t0, ttft


def _measure(path, pp: int, n: int, prompt_len: int, chunk: int, vocab: int) -> dict:
    engine = _engine(path, pp, n, prompt_len, chunk)
    try:
        _prefill(engine, prompts(n, 2 * chunk, vocab, seed=99), "w")  # warm-up
        before, cpu0 = _busy(engine), _cpu(engine)
        wall, ttft = _prefill(engine, prompts(n, prompt_len, vocab, seed=pp), "m")
        busy = [b - a for a, b in zip(before, _busy(engine), strict=True)]
        cpu = [b - a for a, b in zip(cpu0, _cpu(engine), strict=True)]
    finally:
        close = getattr(engine.model, "close", None)
        if close is not None:
            close()
    return {"wall_s": wall, "tok_s": n * prompt_len / wall,
            "ttft_ms_mean": sum(ttft) / len(ttft), "ttft_ms_max": max(ttft),
            "stage_utilisation": [round(b / wall, 3) for b in busy] or [1.0],
            "stage_cpu_s": [round(c, 2) for c in cpu],
            "tok_per_cpu_s": n * prompt_len / sum(cpu)}


def handoff_bytes(path, prompt_len: int) -> list[dict]:
    """Bytes of one `prompt_len`-token handoff for each prefill PP x decode PP (even splits)."""
    from baton.model.config import load_config
    from baton.model.partition import partition_layers
    from baton.model.pools import Pools, PoolSpec
    from transfer.layout import StageLayout
    from transfer.planner import plan

    cfg = load_config(path)
    nb = -(-prompt_len // 16)

    def layouts(pp):
        return [StageLayout.from_pools(Pools(PoolSpec.for_model(
            cfg, num_blocks=nb, tokens_per_block=16, num_slots=1, layers=r)))
            for r in partition_layers(cfg.num_layers, pp)]

    blocks = list(range(nb))
    rows = []
    for p in SIZES:
        for d in (1, 2):
            pairs = {f"{i}->{j}": plan(s, t, blocks, 0, blocks, 0).nbytes
                     for i, s in enumerate(layouts(p)) for j, t in enumerate(layouts(d))}
            rows.append({"prefill_pp": p, "decode_pp": d, "bytes_per_pair": pairs,
                         "bytes_total": sum(pairs.values())})
    return rows


def run(args) -> list[dict]:
    quick = getattr(args, "quick", False)
    # a full batch: one micro-batch per prompt, so stage k+1 always has one from stage k
    preset, prompt_len, n, chunk = ("tiny", 1024, 8, 256) if quick else ("100m", 4096, 4, 512)
    os.environ["BATON_NUM_THREADS"] = "1"  # one torch thread per stage process
    path = checkpoint(preset)
    import json

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    res = {pp: _measure(path, pp, n, prompt_len, chunk, vocab) for pp in SIZES}
    rows = []
    base = res[1]["tok_s"]
    for pp, r in res.items():
        row = {"benchmark": "pp", "label": f"{preset}-pp{pp}", "model": preset,
               "pipeline_parallel_size": pp, "prompts": n, "prompt_tokens": prompt_len,
               "prefill_chunk_size": chunk, "prefill_tok_s": round(r["tok_s"], 1),
               "ttft_ms_mean": round(r["ttft_ms_mean"], 1), "ttft_ms_max": round(r["ttft_ms_max"], 1),
               "stage_utilisation": r["stage_utilisation"], "stage_cpu_s": r["stage_cpu_s"],
               "tok_per_cpu_s": round(r["tok_per_cpu_s"], 1),
               "load_avg_1m": round(os.getloadavg()[0], 2), "baseline": "pp1",
               "baseline_tok_s": round(base, 1), "ratio": round(r["tok_s"] / base, 3),
               "cpu_count": os.cpu_count()}
        if pp == 2:
            row["target_ratio"] = 1.6
        if pp == 3:
            row["ratio_vs_pp2"] = round(r["tok_s"] / res[2]["tok_s"], 3)
            row["target_ratio_vs_pp2"] = 0.85
        print(f"[bench pp] {row}", file=sys.stderr, flush=True)
        rows.append(row)
    for h in handoff_bytes(path, prompt_len):
        rows.append({"benchmark": "pp", "label": f"{preset}-handoff-p{h['prefill_pp']}"
                     f"-d{h['decode_pp']}", "model": preset, "prompt_tokens": prompt_len, **h})
    return rows
