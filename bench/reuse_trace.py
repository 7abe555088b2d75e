"""`baton bench reuse --trace FILE`: replay a public multi-turn trace (Mooncake / AIPerf format)
through a pool smaller than the working set, with and without tiers, LRU and value-aware.

Trace rows: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (ids of 512-token
prefix blocks; equal ids = shared prefix). Scaled to this machine: one trace block becomes
`SCALE` tokens (one KV block), lengths scale alike, token ids are drawn per block id (so equal
ids give equal tokens). Requests: whole conversations (rows sharing a first block id) in order
of first appearance until `--quick` 60 / 150 requests, replayed one at a time in trace order
(arrival times are not replayed: a closed loop on one colocated engine, `tiny`).

Pool sizes are fractions of the working set: KV blocks = the distinct blocks of the replay,
state slots = the snapshots an unbounded pool takes. Rows per pool size:
  lru           LRU, pool only             value         value-aware (Marconi), pool only
  lru+branch    LRU + branch-point snapshots (Marconi's admission); value+branch likewise
  value+tune    value-aware, alpha tuned online (cache.eviction.tune_alpha)
  lru+tiers     LRU + a disk tier >= the working set
  value+tiers   value-aware + the disk tier
Figures: prefill tokens computed / the oracle (tokens no earlier prompt shared), hit tokens per
tier (pool / disk), prefill FLOPs saved (the model's FLOP model over each hit), TTFT p50/p95
(CPU time of the engine thread, torch on that thread alone: other jobs do not inflate it;
wall clock beside it).

Crossover rows (`crossover`), per family: TTFT of a prompt of n + 1 tokens computed from
scratch vs with its first n restored from the disk tier (the snapshot spilled there first),
best of 3, CPU time of the engine thread (wall clock beside it; the entry is in the page
cache, so the disk's own latency is not in it); the restore pays off where
`restore_over_recompute` < 1.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from bench.common import checkpoint, percentile

SCALE = 16
"""Tokens per trace block (the trace's blocks are 512 tokens)."""
TRACE_BLOCK = 512
POLICY = {"periodic_snapshot_interval": 4 * SCALE, "additional_snapshot_offsets_from_end": [0],
          "decode_end_snapshot": False}
FRACTIONS = (1.0, 0.5, 0.25)
ROWS = {"lru": ("lru", False, False), "value": ("value", False, False),
        "value+tune": ("value+tune", False, False),
        "lru+branch": ("lru", False, True), "value+branch": ("value", False, True),
        "lru+tiers": ("lru", True, False), "value+tiers": ("value", True, False)}
"""name: (eviction policy (+tune: alpha tuned online), disk tier, branch-point snapshots
(Marconi's admission))"""


def select(path: str | Path, n: int) -> list[dict]:
    """Whole conversations in order of first appearance until `n` requests, in trace order."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    by_root: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_root[r["hash_ids"][0]].append(r)
    out, roots = [], set()
    for r in rows:
        root = r["hash_ids"][0]
        if root in roots:
            continue
        if len(out) >= n:
            break
        roots.add(root)
        out += by_root[root]
    return sorted(out, key=lambda r: r["timestamp"])


def block_tokens(block_id: int, vocab: int) -> list[int]:
    rng = random.Random(block_id * 7919 + 17)
    return [rng.randrange(3, vocab) for _ in range(SCALE)]


def prompts(rows: list[dict], vocab: int) -> list[tuple[list[int], int]]:
    """(prompt tokens, answer length) per row, scaled."""
    out = []
    for r in rows:
        n = max(1, min(math.ceil(r["input_length"] * SCALE / TRACE_BLOCK),
                       len(r["hash_ids"]) * SCALE))
        toks = [t for b in r["hash_ids"][: -(-n // SCALE)] for t in block_tokens(b, vocab)][:n]
        out.append((toks, max(1, round(r["output_length"] * SCALE / TRACE_BLOCK))))
    return out


def oracle(reqs: list[tuple[list[int], int]]) -> tuple[int, int]:
    """(tokens an ideal cache computes, distinct KV blocks): each prompt's longest block-aligned
    prefix shared with an earlier prompt is free (never its last token)."""
    seen, computed = set(), 0
    for toks, _ in reqs:
        k = 0
        while (k + 1) * SCALE <= len(toks) and tuple(toks[: (k + 1) * SCALE]) in seen:
            k += 1
        computed += len(toks) - min(k * SCALE, len(toks) - 1)
        for i in range(1, -(-len(toks) // SCALE) + 1):
            seen.add(tuple(toks[: i * SCALE]))
    return computed, len(seen)


def _engine(path, blocks: int, slots: int, eviction: str, tier: str | None,
            reuse: bool = True, branch: bool = False):
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine

    cache = {"tokens_per_block": SCALE, "num_blocks": blocks, "num_state_slots": slots,
             "mamba_state_config": {**POLICY, "branch_point_snapshot": branch},
             "eviction": {"policy": eviction.split("+")[0],
                          "tune_alpha": eviction.endswith("+tune")},
             "enable_prefix_reuse": reuse}
    if tier is not None:
        cache["tier"] = {"path": tier, "bytes": 8 << 30, "io": "nixl"}
    cfg = BatonConfig.from_dict({"cache": cache, "worker": {
        "max_num_seqs": 1, "max_model_len": 8192, "max_batch_tokens": 4096,
        "prefill_chunk_size": 2048}})
    return build_engine(cfg, str(path))


def replay(eng, reqs) -> dict:
    from baton.engine.request import Request, SamplingParams

    ttft, cpu, cached = [], [], []
    for i, (toks, out) in enumerate(reqs):
        t0, c0 = time.perf_counter(), time.thread_time()
        eng.add_request(Request(f"r{i}", toks, SamplingParams(max_tokens=out, ignore_eos=True)))
        first = None
        while _has_work(eng):
            for o in eng.step():
                if first is None and o.new_token_ids:
                    first = time.perf_counter() - t0, time.thread_time() - c0
                if o.finished:
                    cached.append(o.cached_tokens)
        first = first or (time.perf_counter() - t0, time.thread_time() - c0)
        ttft.append(first[0])
        cpu.append(first[1])
    return {"ttft": ttft, "ttft_cpu": cpu, "cached": cached}


def _has_work(eng) -> bool:
    """`eng.has_work`, sleeping as the engine loop does while every request waits for a tier
    read (a loop stepping meanwhile would hold the GIL from the I/O thread doing the read)."""
    tiers = eng.cache.tiers
    if tiers is None or not eng.has_work:
        return eng.has_work
    if tiers.on_ready is None:
        tiers.on_ready = threading.Event().set
    ev = tiers.on_ready.__self__
    while not eng.has_ready_work:
        ev.wait(1.0)
        ev.clear()
    return True


def run(args) -> list[dict]:
    import os

    from baton.cache.value import FlopModel
    from baton.model.config import load_config

    os.environ.setdefault("BATON_NUM_THREADS", "1")
    quick = getattr(args, "quick", False)
    rows = select(args.trace, 60 if quick else 150)
    path = checkpoint("tiny")
    mcfg = load_config(path)
    reqs = prompts(rows, mcfg.vocab_size)
    oracle_tokens, ws_blocks = oracle(reqs)
    flops = FlopModel.for_model(mcfg)
    longest = max(-(-len(t) // SCALE) for t, _ in reqs) + 2
    unbounded = _engine(path, ws_blocks + longest, 4 * ws_blocks, "lru", None)
    base = replay(unbounded, reqs)
    ws_slots = unbounded.cache.stats().snapshots_taken
    total = sum(len(t) for t, _ in reqs)
    common = {"benchmark": "reuse_trace", "trace": str(args.trace), "requests": len(reqs),
              "scale_tokens_per_trace_block": SCALE, "prompt_tokens": total,
              "oracle_tokens": oracle_tokens, "working_set_blocks": ws_blocks,
              "working_set_snapshots": ws_slots}
    out = [_row(common, "unbounded", 1.0, unbounded, base, flops, reqs, 0.0)]
    print(f"[bench reuse --trace] {out[-1]}", file=sys.stderr, flush=True)
    for frac in FRACTIONS:
        blocks = max(int(frac * ws_blocks), 1) + longest
        slots = max(int(frac * ws_slots), 1) + 1
        for name, (eviction, tiered, branch) in ROWS.items():
            folder = tempfile.mkdtemp(prefix="baton-tier-") if tiered else None
            t0 = time.perf_counter()
            try:
                eng = _engine(path, blocks, slots, eviction, folder, branch=branch)
                res = replay(eng, reqs)
            finally:
                if folder:
                    shutil.rmtree(folder, ignore_errors=True)
            out.append(_row(common, name, frac, eng, res, flops, reqs, time.perf_counter() - t0))
            print(f"[bench reuse --trace] {out[-1]}", file=sys.stderr, flush=True)
    for family in ("nemotron_h", "qwen3_5"):
        out += crossover(family, CROSS_LENGTHS[:3] if quick else CROSS_LENGTHS)
    return out


CROSS_LENGTHS = (64, 256, 512, 1024, 2048)


def _ttft(eng, rid: str, toks: list[int]) -> tuple[float, float, float]:
    """(wall, CPU of this thread, CPU of the process) seconds to the first token; torch runs
    on this thread alone (BATON_NUM_THREADS=1), so the CPU figure is the engine thread's work,
    whatever else the machine runs; the process figure adds the tiers' I/O thread (the read,
    its checksums) that a restore now runs beside the engine thread."""
    from baton.engine.request import Request, SamplingParams

    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    eng.add_request(Request(rid, toks, SamplingParams(max_tokens=1, ignore_eos=True)))
    while _has_work(eng):
        eng.step()
    return time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0


def crossover(family: str, lengths=CROSS_LENGTHS, repeats: int = 3) -> list[dict]:
    """Recompute vs restore-from-disk TTFT for prompts of n + 1 tokens (n restored)."""
    import os

    os.environ.setdefault("BATON_NUM_THREADS", "1")
    path = checkpoint("tiny", family)
    rows = []
    for n in lengths:
        rng = random.Random(n)
        q = [rng.randrange(3, 200) for _ in range(n + 1)]
        p = q[:n]
        folder = tempfile.mkdtemp(prefix="baton-cross-")
        try:
            eng = _engine(path, 4 * (n // SCALE) + 8, 4, "lru", folder)
            off = _engine(path, 4 * (n // SCALE) + 8, 4, "lru", None, reuse=False)
            recompute, restore = [], []
            for i in range(repeats):
                _ttft(eng, f"w{i}", p)  # the snapshot after p, in the pool
                while eng.cache.tree.evict_snapshot():  # ... spilled to the disk tier
                    pass
                while eng.cache.tree.evict_block():
                    pass
                eng.cache.tiers.flush()  # written (in the background) before the restore
                restore.append(_ttft(eng, f"r{i}", q))
                recompute.append(_ttft(off, f"c{i}", q))
            hits = eng.cache.stats().tiers["disk"]["hits"]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        rc, rs = min(c for _, c, _ in recompute), min(c for _, c, _ in restore)
        rp = min(p for _, _, p in restore)
        rows.append({"benchmark": "reuse_trace", "label": f"crossover:{family}:{n}",
                     "family": family, "restored_tokens": n, "disk_hits": hits,
                     "ttft_recompute_cpu_ms": round(1e3 * rc, 2),
                     "ttft_restore_cpu_ms": round(1e3 * rs, 2),
                     "ttft_restore_process_cpu_ms": round(1e3 * rp, 2),
                     "ttft_recompute_wall_ms": round(1e3 * min(w for w, _, _ in recompute), 2),
                     "ttft_restore_wall_ms": round(1e3 * min(w for w, _, _ in restore), 2),
                     "restore_over_recompute": round(rs / rc, 3),
                     "restore_over_recompute_process": round(rp / rc, 3)})
        print(f"[bench reuse --trace] {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def _row(common, name, frac, eng, res, flops, reqs, wall) -> dict:
    st = eng.cache.stats()
    computed = eng.prefilled_tokens
    disk = st.tiers.get("disk", {})
    saved = sum(flops.saved(c) for c in res["cached"])
    ms = [1e3 * t for t in res["ttft"]]
    cpu = [1e3 * t for t in res["ttft_cpu"]]
    return {**common, "label": f"{name}@{int(frac * 100)}%", "config": name,
            "pool_fraction": frac, "num_blocks": eng.cache.blocks.num_blocks,
            "snapshot_budget": eng.cache.snapshot_budget,
            "prefill_tokens_computed": computed,
            "computed_over_oracle": round(computed / common["oracle_tokens"], 3),
            "pool_hit_tokens": st.hit_tokens - st.tier_hit_tokens,
            "disk_hit_tokens": st.tier_hit_tokens,
            "hit_rate_pool": round((st.hit_tokens - st.tier_hit_tokens)
                                   / common["prompt_tokens"], 3),
            "hit_rate_disk": round(st.tier_hit_tokens / common["prompt_tokens"], 3),
            "disk_hits": disk.get("hits", 0), "disk_admitted": disk.get("admitted", 0),
            "disk_evicted": disk.get("evicted", 0),
            "disk_bytes_written": disk.get("bytes_written", 0),
            "disk_restore_ms_mean": round(1e3 * disk.get("load_seconds", 0.0)
                                          / max(disk.get("hits", 0), 1), 3),
            "prefill_gflops_saved": round(saved / 1e9, 3),
            "ttft_cpu_ms_p50": round(percentile(cpu, 50), 2),
            "ttft_cpu_ms_p95": round(percentile(cpu, 95), 2),
            "ttft_ms_p50": round(percentile(ms, 50), 2),
            "ttft_ms_p95": round(percentile(ms, 95), 2),
            "wall_s": round(wall, 1)}
