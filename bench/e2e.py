"""`baton bench e2e`: the multi-turn workload through colocated engines vs the disaggregated cluster.

Same number of worker processes on both sides: two colocated engine processes (sessions split
between them) against one prefill + one decode worker behind the router. Reports throughput,
time to first token and inter-token latency (p50/p99) from per-token arrival times.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import checkpoint, percentile
from bench.workload import Workload

CONFIG = {
    "cache": {"num_blocks": 4096, "num_state_slots": 96,
              "mamba_state_config": {"periodic_snapshot_interval": 256,
                                     "additional_snapshot_offsets_from_end": [0],
                                     "decode_end_snapshot": True}},
    "worker": {"max_num_seqs": 16, "max_batch_tokens": 1024, "prefill_chunk_size": 512,
               "max_model_len": 8192},
    "router": {"policy": "session"},
}


def _workload(quick: bool) -> Workload:
    if quick:
        return Workload(sessions=6, turns=3, system_len=256, message_len=256, answer_len=24)
    return Workload(sessions=16, turns=4, system_len=1024, message_len=512, answer_len=48)


def run_sessions(submit, wl: Workload, sessions: list[int]) -> list[dict]:
    """Each session in its own thread, turns in order; `submit(rid, ids, session)` yields
    (tokens, arrival time) pairs and returns when the request ends."""
    records: list[dict] = []
    lock = threading.Lock()

    def session(s: int):
        history = wl.system_prompt(s)
        for turn in range(wl.turns):
            ids = history + wl.message(s, turn)
            t0 = time.perf_counter()
            times, toks = [], []
            for new, at in submit(f"s{s}-t{turn}", ids, f"s{s}"):
                toks.extend(new)
                times.extend([at] * len(new))
            with lock:
                records.append({"t0": t0, "times": times, "prompt": len(ids)})
            history = ids + toks

    threads = [threading.Thread(target=session, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def summarize(name: str, records: list[dict], wall: float) -> dict:
    ttft = [(r["times"][0] - r["t0"]) * 1000 for r in records if r["times"]]
    itl = [(b - a) * 1000 for r in records for a, b in zip(r["times"], r["times"][1:], strict=False)]
    tokens = sum(len(r["times"]) for r in records)
    return {
        "mode": name, "requests": len(records), "output_tokens": tokens,
        "throughput_tok_s": round(tokens / wall, 1), "wall_s": round(wall, 2),
        "ttft_p50_ms": round(percentile(ttft, 50), 2), "ttft_p99_ms": round(percentile(ttft, 99), 2),
        "itl_p50_ms": round(percentile(itl, 50), 2), "itl_p99_ms": round(percentile(itl, 99), 2),
    }


def _disaggregated(path: Path, cfg_file: Path, wl: Workload) -> dict:
    import grpc

    from baton.client.remote import to_pb
    from baton.client.requests import RequestSpec
    from baton.cluster.local import LocalCluster, free_port
    from baton.engine.request import SamplingParams
    from baton.proto_gen import router_pb2_grpc

    cluster = LocalCluster(str(path), 1, 1, free_port(), str(cfg_file), log_level="WARNING")
    try:
        cluster.wait_ready()
        ch = grpc.insecure_channel(cluster.address)
        stub = router_pb2_grpc.RouterStub(ch)
        sp = SamplingParams(max_tokens=wl.answer_len, ignore_eos=True)

        def submit(rid, ids, session):
            spec = RequestSpec(rid, prompt_ids=ids, session=session, sampling=sp)
            for msg in stub.Generate(to_pb(spec), timeout=600):
                yield list(msg.token_ids), time.perf_counter()

        t0 = time.perf_counter()
        recs = run_sessions(submit, wl, list(range(wl.sessions)))
        wall = time.perf_counter() - t0
        ch.close()
        return summarize("disaggregated", recs, wall)
    finally:
        cluster.stop()


def _colocated(path: Path, cfg_file: Path, wl: Workload, procs: int = 2) -> dict:
    """`procs` colocated engine processes, each serving its share of the sessions."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for i in range(procs):
            res = Path(tmp) / f"c{i}.json"
            children.append((subprocess.Popen([
                sys.executable, "-m", "bench.e2e_colocated", str(path), str(cfg_file), str(res),
                json.dumps(wl.__dict__), json.dumps(list(range(i, wl.sessions, procs))),
            ]), res))
        for p, res in children:
            if p.wait() != 0:
                raise RuntimeError("colocated engine process failed")
            out.append(json.loads(res.read_text()))
    recs = [r for o in out for r in o["records"]]
    return summarize("colocated", recs, max(o["wall"] for o in out))


def run(args) -> list[dict]:
    import os

    import yaml

    wl = _workload(getattr(args, "quick", False))
    path = checkpoint("tiny")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg_file = Path(tmp) / "e2e.yaml"
        cfg_file.write_text(yaml.safe_dump(CONFIG))
        os.environ.setdefault("BATON_NUM_THREADS", "1")
        colo = _colocated(path, cfg_file, wl)
        dis = _disaggregated(path, cfg_file, wl)
    for r in (colo, dis):
        r.update(benchmark="e2e", label=r["mode"], sessions=wl.sessions, turns=wl.turns)
        rows.append(r)
    dis["ratio"] = round(dis["itl_p99_ms"] / colo["itl_p99_ms"], 3)
    dis["ratio_note"] = "disaggregated p99 ITL / colocated p99 ITL (target <= 0.5)"
    print(f"[bench e2e] {rows}", file=sys.stderr)
    return rows
