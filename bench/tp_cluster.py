"""`baton bench tp`'s cluster rows: one prefill and one decode worker through the router at
prefill / decode TP (1, 1), (2, 1), (1, 2) and (2, 2), the heterogeneous pairs' bytes moved
by NIXL rank to rank. Per pair: requests/s and tokens/s end to end, mean time to first token,
and whether every request's greedy tokens equal the local TP-1 engine's (the correctness
figure; on a 2-core host the ranks share the cores, so TP costs time here, and the rows say
how much).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import yaml

PAIRS = ((1, 1), (2, 1), (1, 2), (2, 2))


def _config(root: Path, p: int, q: int, n: int, length: int, steps: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"tp-cluster-p{p}-d{q}.yaml"
    blocks = n * ((length + steps) // 16 + 2) + 16
    path.write_text(yaml.safe_dump({
        "cache": {"enable_prefix_reuse": False, "num_blocks": blocks,
                  "num_state_slots": 2 * n + 2},
        "router": {"local_prefill_max_tokens": 0, "ship_decode_end_state": False},
        "worker": {"max_num_seqs": n, "max_model_len": length + steps + 8},
        "prefill": {"tensor_parallel_size": p}, "decode": {"tensor_parallel_size": q}}))
    return path


def _measure(path: Path, cfg: Path, specs) -> dict:
    from baton.client.remote import run_remote
    from baton.cluster.local import LocalCluster, free_port

    cluster = LocalCluster(str(path), 1, 1, free_port(), str(cfg), log_level="WARNING")
    try:
        cluster.wait_ready(timeout=300)
        run_remote(cluster.address, specs[:2], concurrency=2)  # warm-up (handshakes)
        t0 = time.perf_counter()
        out = run_remote(cluster.address, specs, concurrency=len(specs))
        return {"wall_s": time.perf_counter() - t0, "results": out}
    finally:
        cluster.stop()


def run(path: Path, vocab: int, quick: bool, root: Path) -> list[dict]:
    from baton.client.local import run_local
    from baton.client.requests import RequestSpec
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine
    from baton.engine.request import SamplingParams
    from bench.common import prompts

    n, length, steps = (8, 64, 16) if quick else (16, 256, 32)
    sp = SamplingParams(max_tokens=steps, ignore_eos=True)
    specs = [RequestSpec(f"c{i}", prompt_ids=ids, sampling=sp)
             for i, ids in enumerate(prompts(n, length, vocab, seed=5))]
    threads = os.environ.get("BATON_NUM_THREADS")
    os.environ["BATON_NUM_THREADS"] = "1"  # each worker's ranks share one thread's worth
    try:
        want = {r["id"]: r["token_ids"] for r in run_local(
            build_engine(BatonConfig.load(_config(root, 1, 1, n, length, steps)), str(path)),
            specs, n)}
        rows = []
        for p, q in PAIRS:
            r = _measure(path, _config(root, p, q, n, length, steps), specs)
            got = {x["id"]: x.get("token_ids") for x in r["results"]}
            ttft = [x["ttft_ms"] for x in r["results"] if "ttft_ms" in x]
            rows.append({"benchmark": "tp", "label": f"{path.name}-cluster-p{p}-d{q}",
                         "prefill_tensor_parallel_size": p, "decode_tensor_parallel_size": q,
                         "requests": n, "prompt_tokens": length, "output_tokens": steps,
                         "requests_per_s": round(n / r["wall_s"], 2),
                         "output_tok_s": round(n * steps / r["wall_s"], 1),
                         "mean_ttft_ms": round(sum(ttft) / max(len(ttft), 1), 1),
                         "tokens_equal_local_tp1": got == want, "cpu_count": os.cpu_count(),
                         "load_avg_1m": round(os.getloadavg()[0], 2)})
        return rows
    finally:
        if threads is None:
            os.environ.pop("BATON_NUM_THREADS", None)
        else:
            os.environ["BATON_NUM_THREADS"] = threads
