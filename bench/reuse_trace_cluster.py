"""`baton bench reuse --trace FILE --cluster`: the trace replay of bench/reuse_trace.py through a
cluster: 1 prefill + 1 decode worker behind the router (`prefix_aware`), one config for both
(as `baton serve` gives it: they share the disk tier's folder), TTFT at the client.

Requests as in reuse_trace.py (whole conversations in trace order, scaled: one trace block =
16 tokens; `--quick` 60 requests, else 150), one at a time (closed loop; arrival times are
not replayed). Pools per worker at 100 / 50 / 25% of the working set (KV blocks: the distinct
blocks of the replay; state slots: the distinct snapshot points), rows per pool size (and
at 25% again through 2 prefill + 2 decode workers):

    lru           LRU, pool only
    lru+tiers     LRU + a disk tier >= the working set
    value+tiers   value-aware eviction + the disk tier

Figures: prefill tokens computed on both workers (Stats `prefilled_tokens`) over the oracle,
tokens restored from the disk tier (Stats `tier_hit_tokens`), TTFT p50 / p95 (wall, client
side, first streamed token: the machine is shared, so compare rows of one run as ratios).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time

from bench.common import checkpoint, percentile, worker_stats
from bench.reuse_trace import FRACTIONS, POLICY, SCALE, oracle, prompts, select

ROWS = {"lru": ("lru", False), "lru+tiers": ("lru", True), "value+tiers": ("value", True)}
MAX_SEQS = 2


def snapshot_points(reqs) -> int:
    """Distinct snapshot points of the replay (what an unbounded pool holds)."""
    from baton.cache.policy import snapshot_points as points
    from baton.config.cache import MambaStateConfig

    policy = MambaStateConfig(**POLICY)
    return len({tuple(t[:p]) for t, _ in reqs for p in points(policy, len(t))})


def config(blocks: int, slots: int, eviction: str, tier: str | None) -> dict:
    cache = {"tokens_per_block": SCALE, "num_blocks": blocks, "num_state_slots": slots,
             "mamba_state_config": POLICY, "eviction": {"policy": eviction}}
    if tier is not None:
        cache["tier"] = {"path": tier, "bytes": 8 << 30, "io": "nixl"}
    return {"cache": cache,
            "worker": {"max_num_seqs": MAX_SEQS, "max_model_len": 8192,
                       "max_batch_tokens": 4096, "prefill_chunk_size": 2048},
            "router": {"policy": "prefix_aware", "heartbeat_seconds": 0.3}}


def replay(path, cfg_file, reqs, prefill: int = 1, decode: int = 1) -> dict:
    from baton.client.remote import to_pb
    from baton.client.requests import RequestSpec
    from baton.cluster.local import LocalCluster, free_port
    from baton.engine.request import SamplingParams
    from baton.proto_gen import router_pb2_grpc

    cluster = LocalCluster(str(path), prefill, decode, free_port(), str(cfg_file),
                           log_level="WARNING")
    try:
        cluster.wait_ready()
        ch = cluster.channel()
        stub = router_pb2_grpc.RouterStub(ch)
        ttft, cached = [], []
        for i, (toks, out) in enumerate(reqs):
            spec = RequestSpec(f"r{i}", prompt_ids=toks,
                               sampling=SamplingParams(max_tokens=out, ignore_eos=True))
            t0, first, last = time.perf_counter(), None, None
            for m in stub.Generate(to_pb(spec), timeout=600):
                if first is None and m.token_ids:
                    first = time.perf_counter() - t0
                last = m
            ttft.append(first if first is not None else time.perf_counter() - t0)
            cached.append(last.cached_tokens if last is not None else 0)
        counters = _counters(stub, cluster.secret.bearer)
        ch.close()
    finally:
        cluster.stop()
    return {"ttft": ttft, "cached": cached, "counters": counters}


def _counters(stub, bearer: str) -> dict[str, float]:
    """Stats counters summed over the workers."""
    out: dict[str, float] = {}
    for _, c in worker_stats(stub, bearer):
        for k, v in c.items():
            out[k] = out.get(k, 0.0) + v
    return out


def run(args) -> list[dict]:
    import os
    from pathlib import Path

    import yaml

    from baton.model.config import load_config

    os.environ.setdefault("BATON_NUM_THREADS", "1")
    quick = getattr(args, "quick", False)
    rows = select(args.trace, 60 if quick else 150)
    path = checkpoint("tiny")
    reqs = prompts(rows, load_config(path).vocab_size)
    oracle_tokens, ws_blocks = oracle(reqs)
    ws_slots = snapshot_points(reqs)
    longest = max(-(-len(t) // SCALE) for t, _ in reqs) + 2
    common = {"benchmark": "reuse_trace_cluster", "trace": str(args.trace),
              "topology": "1P+1D", "requests": len(reqs), "oracle_tokens": oracle_tokens,
              "prompt_tokens": sum(len(t) for t, _ in reqs), "working_set_blocks": ws_blocks,
              "working_set_snapshots": ws_slots}
    out = []
    tmp = Path(tempfile.mkdtemp(prefix="baton-trace-cluster-"))
    try:
        for frac in FRACTIONS:
            blocks = max(int(frac * ws_blocks), 1) + MAX_SEQS * longest
            slots = max(int(frac * ws_slots), 1) + MAX_SEQS + 1
            for name, (eviction, tiered) in ROWS.items():
                folder = tempfile.mkdtemp(prefix="baton-tier-") if tiered else None
                cfg = tmp / f"{name}-{int(frac * 100)}.yaml"
                cfg.write_text(yaml.safe_dump(config(blocks, slots, eviction, folder)))
                t0 = time.perf_counter()
                try:
                    res = replay(path, cfg, reqs)
                finally:
                    if folder:
                        shutil.rmtree(folder, ignore_errors=True)
                out.append(_row(common, name, frac, blocks, slots, res,
                                time.perf_counter() - t0))
                print(f"[bench reuse --trace --cluster] {out[-1]}", file=sys.stderr, flush=True)
        frac = FRACTIONS[-1]  # 2P+2D at the smallest pool: tiers shared by two workers a role
        blocks = max(int(frac * ws_blocks), 1) + MAX_SEQS * longest
        slots = max(int(frac * ws_slots), 1) + MAX_SEQS + 1
        for name, (eviction, tiered) in ROWS.items():
            folder = tempfile.mkdtemp(prefix="baton-tier-") if tiered else None
            cfg = tmp / f"{name}-2x2.yaml"
            cfg.write_text(yaml.safe_dump(config(blocks, slots, eviction, folder)))
            t0 = time.perf_counter()
            try:
                res = replay(path, cfg, reqs, 2, 2)
            finally:
                if folder:
                    shutil.rmtree(folder, ignore_errors=True)
            row = _row({**common, "topology": "2P+2D"}, name, frac, blocks, slots, res,
                       time.perf_counter() - t0)
            row["label"] = f"2P+2D:{row['label']}"
            out.append(row)
            print(f"[bench reuse --trace --cluster] {out[-1]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    by = {r["label"]: r for r in out}
    for r in out:
        pre = "2P+2D:" if r["topology"] == "2P+2D" else ""
        base = by.get(f"{pre}lru@{int(r['pool_fraction'] * 100)}%")
        if base and r is not base:
            r["ttft_p95_over_lru"] = round(r["ttft_ms_p95"] / max(base["ttft_ms_p95"], 1e-9), 3)
            r["ttft_p50_over_lru"] = round(r["ttft_ms_p50"] / max(base["ttft_ms_p50"], 1e-9), 3)
    return out


def _row(common, name, frac, blocks, slots, res, wall) -> dict:
    c = res["counters"]
    computed = c.get("prefilled_tokens", 0.0)
    ms = [1e3 * t for t in res["ttft"]]
    return {**common, "label": f"{name}@{int(frac * 100)}%", "config": name,
            "pool_fraction": frac, "num_blocks": blocks, "num_state_slots": slots,
            "prefill_tokens_computed": int(computed),
            "computed_over_oracle": round(computed / common["oracle_tokens"], 3),
            "cached_tokens": sum(res["cached"]),
            "disk_hit_tokens": int(c.get("tier_hit_tokens", 0.0)),
            "disk_hits": int(c.get("tier_disk_hits", 0.0)),
            "disk_admitted": int(c.get("tier_disk_admitted", 0.0)),
            "ttft_ms_p50": round(percentile(ms, 50), 2),
            "ttft_ms_p95": round(percentile(ms, 95), 2),
            "wall_s": round(wall, 1)}
