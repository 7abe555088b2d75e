"""`baton bench tp`: the local engine at tensor-parallel size 1, 2 and 4 with the same
total torch threads (the host's cores split between the ranks): prefill and decode
tokens/s, weights + pool bytes and resident memory per rank, and the collectives per
decode step (count and seconds, from every rank's counters).

On a CPU host with few cores TP only divides the threads the ranks share, and every layer
adds a gloo all-reduce: expect it slower than TP 1. TP here is for capacity (each rank
holds 1/N of the weights and cache) and correctness, and the figures say by how much.
Cluster rows (`bench/tp_cluster.py`): prefill / decode TP pairs through the router.

MoE rows (`label` ...-moe-...): a NemotronH MoE (bench engine's MoE model: 32 experts, top 4)
and a Qwen3.5-MoE (8 experts, top 2), each at TP 1 and at TP 2 and 4 with both
`worker.moe_tp_split` values: whole experts per rank vs every expert split within, the
measurement behind the default.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from bench.common import cache_dir, checkpoint, cpu_seconds, prompts

SIZES = (1, 2, 4)


def _model(quick: bool) -> Path:
    if not quick:
        return checkpoint("100m")  # n_groups 4, 12 heads / 4 KV heads: TP 1, 2, 4 divide
    from baton.model.make_model import write_checkpoint

    path = cache_dir() / "bench-tp-quick-v1"
    if not (path / "config.json").is_file():
        write_checkpoint(path, seed=1, n_groups=4)
    return path


def _moe_models(quick: bool) -> dict[str, Path]:
    from baton.model.qwen3_5.moe_make import write_checkpoint
    from bench.moe import checkpoints

    qwen = cache_dir() / f"bench-tp-qwen3_5_moe-{'tiny' if quick else '100m'}-v1"
    if not (qwen / "config.json").is_file():
        write_checkpoint(qwen, preset="tiny" if quick else "100m", seed=1)
    return {"nemotron_h-moe": checkpoints(quick)["moe"], "qwen3_5-moe": qwen}


def _engine(path, tp: int, n: int, prompt_len: int, steps: int, split: str = "experts"):
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine

    cfg = BatonConfig.from_dict({
        "cache": {"enable_prefix_reuse": False, "num_blocks": n * ((prompt_len + steps) // 16
                                                                   + 2) + 16,
                  "num_state_slots": n + 1},
        "worker": {"max_num_seqs": n, "max_batch_tokens": n * prompt_len,
                   "prefill_chunk_size": prompt_len, "max_model_len": prompt_len + steps + 8,
                   "tensor_parallel_size": tp, "moe_tp_split": split},
    })
    return build_engine(cfg, str(path))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def _rank_bytes(engine) -> dict:
    model = getattr(engine.model, "shard", engine.model)
    pools = getattr(engine.pools, "local", engine.pools)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = sum(t.numel() * t.element_size() for t in pools.tensors)
    return {"weight_bytes_per_rank": weights, "pool_bytes_per_rank": cache}


def _collectives(engine) -> list[dict]:
    stats = getattr(engine.model, "rank_stats", None)
    return stats() if stats is not None else [{"collectives": 0, "collective_s": 0.0}]


def _pids(engine) -> list[int]:
    ranks = getattr(engine.model, "local_stages", None)
    return [os.getpid(), *(ranks.pids().values() if ranks is not None else [])]


def _cpu(pids: list[int]) -> list[float]:
    return [cpu_seconds(p) for p in pids]


def _run(engine, reqs, steps: int, tag: str) -> dict:
    """Prefill every prompt (until each has its first token), then decode to the end.
    Besides wall time, each rank's CPU seconds per phase: on a loaded host the wall clock
    mostly measures the other processes, a rank's CPU time much less so."""
    from baton.engine.request import Request, SamplingParams

    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for i, p in enumerate(reqs):
        engine.add_request(Request(f"{tag}{i}", p, sp))
    pids = _pids(engine)
    cpu0 = _cpu(pids)
    t0, first, done = time.perf_counter(), set(), 0
    while len(first) < len(reqs):
        for out in engine.step():
            first.add(out.request_id)
            done += out.finished
    t1, c1, n_steps, cpu1 = time.perf_counter(), _collectives(engine), 0, _cpu(pids)
    while done < len(reqs):
        outs = engine.step()
        n_steps += 1
        done += sum(o.finished for o in outs)
    t2, c2, cpu2 = time.perf_counter(), _collectives(engine), _cpu(pids)
    per_rank = [{"collectives_per_step": round((b["collectives"] - a["collectives"])
                                               / max(n_steps, 1), 1),
                 "collective_ms_per_step": round(1e3 * (b["collective_s"] - a["collective_s"])
                                                 / max(n_steps, 1), 3)}
                for a, b in zip(c1, c2, strict=True)]
    for i, row in enumerate(per_rank):
        row["prefill_cpu_s"] = round(cpu1[i] - cpu0[i], 2)
        row["decode_cpu_ms_per_step"] = round(1e3 * (cpu2[i] - cpu1[i]) / max(n_steps, 1), 1)
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": n_steps,
            "per_rank": per_rank}


def _measure(path, tp: int, n: int, prompt_len: int, steps: int, vocab: int,
             split: str = "experts") -> dict:
    engine = _engine(path, tp, n, prompt_len, steps, split)
    try:
        _run(engine, prompts(n, prompt_len, vocab, seed=99), 4, "w")  # warm-up, same shapes
        r = _run(engine, prompts(n, prompt_len, vocab, seed=7), steps, "m")
        r["rss_mib_per_rank"] = [_rss_mib(p) for p in _pids(engine)]
        r.update(_rank_bytes(engine))
    finally:
        close = getattr(engine.model, "close", None)
        if close is not None:
            close()
    return r


def run(args) -> list[dict]:
    import json

    quick = getattr(args, "quick", False)
    n, prompt_len, steps = (4, 128, 16) if quick else (4, 512, 32)
    os.environ.setdefault("BATON_NUM_THREADS", str(os.cpu_count() or 1))
    path = _model(quick)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    total = os.environ["BATON_NUM_THREADS"]
    res = {(tp, total): _measure(path, tp, n, prompt_len, steps, vocab) for tp in SIZES}
    # TP 1 on one thread too: on a loaded host a multi-threaded TP 1 can lose more to its
    # threads waiting for each other than to TP's all-reduces; this row tells them apart
    os.environ["BATON_NUM_THREADS"] = "1"
    try:
        res[1, "1"] = _measure(path, 1, n, prompt_len, steps, vocab)
    finally:
        os.environ["BATON_NUM_THREADS"] = total
    rows = _rows(path.name, res, res[1, total], n, prompt_len)
    for name, mpath in _moe_models(quick).items():
        mvocab = json.loads((mpath / "config.json").read_text())["vocab_size"]
        mres = {(1, total, "experts"): _measure(mpath, 1, n, prompt_len, steps, mvocab)}
        for tp in SIZES[1:]:
            for split in ("experts", "within"):
                mres[tp, total, split] = _measure(mpath, tp, n, prompt_len, steps, mvocab, split)
        rows += _rows(name, mres, mres[1, total, "experts"], n, prompt_len)
    from bench import tp_cluster

    for row in tp_cluster.run(path, vocab, quick, cache_dir()):  # prefill / decode TP pairs
        print(f"[bench tp] {row}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def _rows(name: str, res: dict, base: dict, n: int, prompt_len: int) -> list[dict]:
    rows = []
    for key, r in res.items():
        tp, threads = key[:2]
        split = key[2] if len(key) > 2 else None
        pre = n * prompt_len / r["prefill_s"]
        dec = n * r["decode_steps"] / r["decode_s"]
        row = {"benchmark": "tp",
               "label": f"{name}-tp{tp}{f'-{split}' if split and tp > 1 else ''}-t{threads}",
               "tensor_parallel_size": tp, **({"moe_tp_split": split} if split else {}),
               "prompts": n, "prompt_tokens": prompt_len, "decode_steps": r["decode_steps"],
               "total_threads": int(threads), "threads_per_rank": max(1, int(threads) // tp),
               "prefill_tok_s": round(pre, 1), "decode_tok_s": round(dec, 1),
               "prefill_ratio_vs_tp1": round(pre / (n * prompt_len / base["prefill_s"]), 3),
               "decode_ratio_vs_tp1": round(dec / (n * base["decode_steps"]
                                                   / base["decode_s"]), 3),
               "weight_bytes_per_rank": r["weight_bytes_per_rank"],
               "pool_bytes_per_rank": r["pool_bytes_per_rank"],
               "rss_mib_per_rank": r["rss_mib_per_rank"], "per_rank": r["per_rank"],
               "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
        print(f"[bench tp] {row}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows
