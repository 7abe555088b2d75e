"""`baton bench handoff`: what the disaggregated path adds to one request's time to first token.

One request at a time, prompts of 512, 2k and 8k tokens (prefix reuse off): TTFT through the
router (1 prefill + 1 decode worker) minus the same prompt's TTFT in the colocated engine
(`baton generate --local`, in this process), both with the same torch threads as one worker,
measured alternately prompt by prompt. Both handoff modes: whole request, layer-wise.
Each size's row has the median of every phase of the cluster requests (`phases_p50_ms`,
baton/worker/phases.py; `c_to_client`: the client's TTFT minus the router's), printed as a
breakdown next to the total on stderr.
Also the CPU time every cluster process spends in an idle window (idle must mean idle), and
the prefill worker's own handoff timings (Stats counters).

    python -m bench.handoff [--sizes 512 2048 8192] [--trials 7] [--idle-s 60] [--modes both]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import checkpoint, cpu_seconds, prompts

SIZES = (512, 2048, 8192)
CONFIG = {
    "cache": {"num_blocks": 2048, "num_state_slots": 16, "enable_prefix_reuse": False},
    "worker": {"max_num_seqs": 4, "max_batch_tokens": 2048, "prefill_chunk_size": 2048,
               "max_model_len": 8448},
}
PROFILES = {"bench": CONFIG, "serve": {}}
"""`bench`: prefix reuse off, one chunk of 2048 tokens; `serve`: `baton serve --model tiny`'s
defaults (prefix reuse and its snapshots, 512-token chunks, decode-end snapshots shipped back,
conditional disaggregation)."""
THREADS = "1"
"""torch threads per worker process, and for the colocated engine."""


def _local_ttft(engine, ids: list[int], rid: str) -> float:
    """TTFT (ms) of one prompt in the colocated engine (what `baton generate --local` runs)."""
    from baton.client.local import run_local
    from baton.client.requests import RequestSpec
    from baton.contract import SamplingParams

    (res,) = run_local(engine, [RequestSpec(rid, prompt_ids=ids,
                                            sampling=SamplingParams(max_tokens=1))])
    return res["ttft_ms"]


def _cluster_ttft(stub, reqs: list[list[int]], tag: str,
                  phases: list[dict] | None = None) -> list[float]:
    """Client TTFTs (ms); each request's phases appended to `phases` (with `c_to_client`)."""
    from baton.contract import GenerateInput, SamplingParams, wire
    from baton.worker.phases import AT_FIRST_CHUNK, from_metadata

    out = []
    for i, ids in enumerate(reqs):
        msg = wire.generate_to_pb(
            GenerateInput(f"{tag}-{i}", tuple(ids), None, SamplingParams(max_tokens=2)))
        t0 = time.perf_counter()
        first = None
        call = stub.Generate(msg, timeout=600)
        for _ in call:  # 2 tokens: the handoff must happen
            if first is None:
                got_at = time.monotonic()
                first = (time.perf_counter() - t0) * 1000
        out.append(first)
        got = from_metadata(call.trailing_metadata())
        if phases is not None and got:
            if "r_ttft" in got:
                got["c_to_client"] = round(first - got["r_ttft"], 3)
            left = got.pop(AT_FIRST_CHUNK, None)
            if left is not None and "c_to_client" in got and \
                    0 <= got_at * 1000 - left <= got["c_to_client"]:  # the router's host clock
                got["c_out"] = round(got_at * 1000 - left, 3)
                got["c_in"] = round(got["c_to_client"] - got["c_out"], 3)
            # what the path adds to the prompt's own compute, whatever that took here
            got["fixed"] = round(first - got.get("p_forward", 0) - got.get("p_sample", 0), 3)
            phases.append(got)
    return out


def phase_medians(phases: list[dict]) -> dict[str, float]:
    """Each phase's median over the requests that measured it, in the order they happen."""
    names = list(dict.fromkeys(k for p in phases for k in p))
    return {k: round(statistics.median(p[k] for p in phases if k in p), 3) for k in names}


ON_PATH = ("c_in", "r_route", "r_open", "p_queue", "p_forward", "p_sample", "p_output",
           "p_post", "p_landed", "p_wake", "p_release", "r_reply", "r_first_chunk", "c_out")
"""The phases one after another on the way to the first token (the others overlap them)."""


def breakdown(row: dict) -> str:
    """One line: the overhead, then each phase's median (ms)."""
    p = row.get("phases_p50_ms") or {}
    parts = " ".join(f"{k}={p[k]:.2f}" for k in p)
    return (f"[handoff] {row['label']}: colocated {row['local_ttft_p50_ms']:.1f} ms, cluster "
            f"{row['cluster_ttft_p50_ms']:.1f} ms, overhead {row['overhead_p50_ms']:.2f} ms "
            f"(fixed {row['fixed_overhead_p50_ms']} ms) | {parts}")


def _idle_cpu(cluster, seconds: float) -> dict[str, float]:
    """Share of one core each cluster process used while idle for `seconds`."""
    names = {p.pid: p.args[p.args.index("--log-level") + 2] for p in cluster.procs}
    before = {pid: cpu_seconds(pid) for pid in names}
    time.sleep(seconds)
    return {f"{names[pid]}-{pid}": round((cpu_seconds(pid) - before[pid]) / seconds, 4)
            for pid in names}


def _prefill_counters(cluster) -> dict[str, float]:
    import grpc

    from baton.auth.grpc_auth import authorized
    from baton.contract import Role, wire
    from baton.proto_gen import baton_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc

    with grpc.insecure_channel(cluster.address) as ch:
        workers = router_pb2_grpc.RouterStub(ch).ListWorkers(router_pb2.ListWorkersRequest())
    addr = next(w.address for w in workers.workers if wire.role_from_pb(w.role) is Role.PREFILL)
    with authorized(grpc.insecure_channel(addr), cluster.secret.bearer) as ch:
        stats = worker_pb2_grpc.PrefillWorkerStub(ch).Stats(baton_pb2.StatsRequest())
    return dict(stats.counters)


def _cluster(path: Path, cfg_file: Path, sets: dict, idle_s: float) -> tuple:
    """(colocated TTFTs, cluster TTFTs, phases, by size; idle CPU per process, prefill worker
    counters) of one fresh cluster."""
    import grpc

    from baton.client.remote import CHANNEL_OPTIONS
    from baton.cluster.local import LocalCluster, free_port
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine
    from baton.proto_gen import router_pb2_grpc

    os.environ["BATON_NUM_THREADS"] = THREADS
    engine = build_engine(BatonConfig.load(cfg_file), str(path))  # the same threads as a worker
    cluster = LocalCluster(str(path), 1, 1, free_port(), str(cfg_file), log_level="WARNING")
    try:
        cluster.wait_ready()
        idle = _idle_cpu(cluster, idle_s) if idle_s else {}
        with grpc.insecure_channel(cluster.address, options=CHANNEL_OPTIONS) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            warm = prompts(2, 64, 512, seed=99)
            _cluster_ttft(stub, warm, "warm")
            _local_ttft(engine, warm[0], "warm")
            # side by side, one prompt at a time, so drift on a shared machine hits both
            local, remote, phases = {}, {}, {}
            for n, reqs in sets.items():
                for i, ids in enumerate(reqs):
                    local.setdefault(n, []).append(_local_ttft(engine, ids, f"l{n}-{i}"))
                    remote.setdefault(n, []).extend(_cluster_ttft(
                        stub, [ids], f"n{n}-{i}", phases.setdefault(n, [])))
        return local, remote, phases, idle, _prefill_counters(cluster)
    finally:
        cluster.stop()


def run(args) -> list[dict]:
    import yaml

    quick = getattr(args, "quick", False)
    trials = getattr(args, "trials", None) or (3 if quick else 7)
    idle_s = getattr(args, "idle_s", None)
    idle_s = (10.0 if quick else 60.0) if idle_s is None else idle_s
    sizes = tuple(getattr(args, "sizes", None) or SIZES)
    modes = {"both": (False, True), "whole": (False,), "layerwise": (True,)}[
        getattr(args, "modes", None) or "both"]
    profile = getattr(args, "profile", None) or "bench"
    path = checkpoint("tiny")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sets = {n: prompts(trials, n, 512, seed=n) for n in sizes}
        results = {}
        for layerwise in modes:
            cfg_file = Path(tmp) / f"handoff-{layerwise}.yaml"
            cfg_file.write_text(yaml.safe_dump({**PROFILES[profile],
                                                "transfer": {"layerwise": layerwise}}))
            results[layerwise] = _cluster(path, cfg_file, sets, idle_s if not results else 0)
    for layerwise, (local, remote, phases, _, counters) in results.items():
        for n in sizes:
            over = [r - lo for r, lo in zip(remote[n], local[n], strict=True)]
            p50_local = statistics.median(local[n])
            rows.append({
                "benchmark": "handoff",
                "label": f"{n} tokens, layerwise {layerwise}" + (
                    f", {profile} config" if profile != "bench" else ""),
                "prompt_tokens": n, "layerwise": layerwise, "trials": trials, "profile": profile,
                "torch_threads": int(THREADS),
                "local_ttft_p50_ms": round(p50_local, 2),
                "cluster_ttft_p50_ms": round(statistics.median(remote[n]), 2),
                "overhead_p50_ms": round(statistics.median(over), 2),
                "overhead_pct_of_prefill": round(100 * statistics.median(over) / p50_local, 2),
                "ratio": round(statistics.median(remote[n]) / p50_local, 3),
                "ratio_note": "cluster TTFT p50 / colocated TTFT p50",
                "phases_p50_ms": phase_medians(phases.get(n, [])),
                "fixed_overhead_p50_ms": phase_medians(phases.get(n, [])).get("fixed"),
                "fixed_note": "client TTFT minus the prefill worker's forward and first draw: "
                              "the handoff's cost without the compute's noise",
                "phases_on_path": list(ON_PATH),
            })
            print(breakdown(rows[-1]), file=sys.stderr, flush=True)
        keep = ("handoffs", "streamed_handoffs", "compute_s_total", "handoff_s_total",
                "tail_s_total", "last_handoff_ms", "last_tail_ms")
        rows.append({"benchmark": "handoff", "label": f"prefill worker, layerwise {layerwise}",
                     "last_is_8k_tokens": True, **{k: counters.get(k) for k in keep}})
    idle = results[modes[0]][3]
    if not idle:
        return rows
    rows.append({"benchmark": "handoff", "label": "idle cpu", "idle_seconds": idle_s,
                 "cores_used_per_process": idle,
                 "max_idle_worker_cores": max(v for k, v in idle.items() if "worker" in k),
                 "target": "< 0.02 cores per idle worker"})
    return rows


def main(argv: list[str] | None = None) -> int:
    """`make bench-handoff`: a short run (a minute) that prints the figure, never fails on it."""
    p = argparse.ArgumentParser(prog="bench.handoff", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="prompt tokens")
    p.add_argument("--trials", type=int, default=None, help="prompts per size (default 7)")
    p.add_argument("--idle-s", type=float, default=None, help="idle CPU window (default 60)")
    p.add_argument("--modes", choices=["both", "whole", "layerwise"], default="both")
    p.add_argument("--profile", choices=list(PROFILES), default="bench",
                   help="cluster config: bench (reuse off, 2k chunks) or serve (its defaults)")
    p.add_argument("--quick", action="store_true", help="3 prompts a size, 10 s idle")
    for r in run(p.parse_args(argv)):
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
