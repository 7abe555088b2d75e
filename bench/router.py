"""Router benchmark: routing decisions per second and the latency the router adds per request.

    python -m bench.router --json [--prefixes 10000] [--prompt-len 1024] [--requests 2000]

Two measurements:
  decision  policy.choose (prompt hashing + index lookups) plus the registry read, with the
            prefix_aware index holding `--prefixes` snapshot prefixes over 8 + 8 workers.
  grpc      Generate through a router process (max_tokens=2) against instant fake workers
            in a third process, versus the client making the same Reserve + Prefill + Decode
            calls itself: the difference is the router's added latency, one more gRPC hop
            included (target: < 1 ms p50).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import random
import statistics
import sys
import time

import grpc

from baton.config.router import RouterConfig
from baton.contract import Role, SnapshotEvent, WorkerInfo, WorkerLoad
from baton.contract.prefix_hash import snapshot_key
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import router_pb2_grpc as rgrpc
from baton.proto_gen import worker_pb2 as wpb
from baton.proto_gen import worker_pb2_grpc as wgrpc
from router.policies import RouteRequest, make_policy
from router.registry import Registry
from router.server import run_router
from tests.support.fake_workers import FakeWorker

TARGET_P50_MS = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.router", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one JSON object a measurement")
    p.add_argument("--prefixes", type=int, default=10_000, help="snapshot prefixes tracked")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--requests", type=int, default=2000, help="routing decisions timed")
    p.add_argument("--grpc-requests", type=int, default=300, help="Generate calls timed")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    """Rows for `baton bench router`; options missing from `args` take parse_args' defaults."""
    opts = parse_args([])
    for key, value in vars(args).items():
        if hasattr(opts, key) and type(value) is type(getattr(opts, key)):
            setattr(opts, key, value)
    if getattr(args, "quick", False):
        opts.requests, opts.grpc_requests = min(opts.requests, 300), min(opts.grpc_requests, 100)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # quiets GOAWAY notes at child shutdown
    return [_decision(opts), _grpc(opts)]


def _percentiles(samples_s: list[float], prefix: str = "") -> dict:
    ms = sorted(s * 1000 for s in samples_s)
    return {
        f"{prefix}p50_ms": round(statistics.median(ms), 4),
        f"{prefix}p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 4),
        f"{prefix}mean_ms": round(statistics.fmean(ms), 4),
    }


def _decision(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    tpb, length = args.tokens_per_block, args.prompt_len
    config = RouterConfig(policy="prefix_aware", prefix_tree_max_nodes=max(args.prefixes, 1))
    policy = make_policy(config)
    registry = Registry(1e9, [policy])
    for role, prefix in ((Role.PREFILL, "p"), (Role.DECODE, "d")):
        for i in range(8):
            registry.register(WorkerInfo(f"{prefix}{i}", role, f"h:{i}", tpb, WorkerLoad(i % 3)))
    prompts = []
    for i in range(args.prefixes):
        prompt = tuple(rng.randrange(32_000) for _ in range(length))
        n = rng.randrange(tpb, length, tpb) if i % 2 else length - rng.randrange(1, 30)
        policy.observe(f"p{i % 8}", [SnapshotEvent(True, *snapshot_key(prompt, n, tpb))])
        if len(prompts) < 256:
            prompts.append(prompt)
    requests = []
    for i in range(args.requests):
        if i % 2:  # shares a tracked prompt's first half, then diverges
            base = prompts[i % len(prompts)]
            prompt = base[: length // 2] + tuple(rng.randrange(32_000) for _ in range(length // 2))
        else:
            prompt = tuple(rng.randrange(32_000) for _ in range(length))
        requests.append(RouteRequest(str(i), prompt))
    gc.collect()
    gc.freeze()  # the bench's own prompt tuples would otherwise dominate p99 with GC pauses
    samples, chosen = [], []
    start = time.perf_counter()
    for req in requests:
        t0 = time.perf_counter()
        choice = policy.choose(req, registry.workers(Role.PREFILL), registry.workers(Role.DECODE))
        samples.append(time.perf_counter() - t0)
        chosen.append(choice.prefill)
    elapsed = time.perf_counter() - start
    gc.unfreeze()
    hits = sum(
        policy.matched_tokens(req.prompt_ids, [w]).get(w.worker_id, 0) > 0
        for req, w in zip(requests, chosen, strict=True)
    )
    stats = _percentiles(samples)
    return {
        "benchmark": "router",
        "label": "decision",
        "policy": "prefix_aware",
        "tracked_prefixes": len(policy.index),
        "prompt_len": length,
        "tokens_per_block": tpb,
        "workers": 16,
        "requests": args.requests,
        "decisions_per_s": round(args.requests / elapsed, 1),
        **stats,
        "routed_to_a_snapshot_hit": round(hits / len(requests), 3),
        "target_p50_ms": TARGET_P50_MS,
        "meets_target": stats["p50_ms"] < TARGET_P50_MS,
    }


def _grpc(args: argparse.Namespace) -> dict:
    ctx = multiprocessing.get_context("spawn")
    router_conn, router_child = ctx.Pipe()
    workers_conn, workers_child = ctx.Pipe()
    procs = [ctx.Process(target=_serve_router, args=(router_child,), daemon=True)]
    procs[0].start()
    router_address = router_conn.recv()
    procs.append(
        ctx.Process(target=_serve_fakes, args=(workers_child, router_address), daemon=True)
    )
    procs[1].start()
    p_address, d_address = workers_conn.recv()
    channels = [grpc.insecure_channel(a) for a in (router_address, p_address, d_address)]
    try:
        routed, baseline = _time_both(args, *channels)
    finally:
        for ch in channels:
            ch.close()
        for conn in (router_conn, workers_conn):
            conn.send("stop")
        for proc in procs:
            proc.join(10)
    r, b = _percentiles(routed), _percentiles(baseline, "baseline_")
    added = round(r["p50_ms"] - b["baseline_p50_ms"], 4)
    return {
        "benchmark": "router",
        "label": "grpc",
        "policy": "prefix_aware",
        "prompt_len": args.prompt_len,
        "requests": args.grpc_requests,
        "processes": "client, router, fake workers",
        **r,
        "baseline": "client calls Reserve + Prefill + Decode itself",
        **b,
        "added_p50_ms": added,
        "ratio": round(r["p50_ms"] / b["baseline_p50_ms"], 3),
        "ratio_note": "p50 through the router / p50 of the direct calls",
        "target_p50_ms": TARGET_P50_MS,
        "meets_target": added < TARGET_P50_MS,
    }


def _time_both(args, router_ch, p_ch, d_ch) -> tuple[list[float], list[float]]:
    router = rgrpc.RouterStub(router_ch)
    pre, dec = wgrpc.PrefillWorkerStub(p_ch), wgrpc.DecodeWorkerStub(d_ch)
    prompt = list(range(1, args.prompt_len + 1))
    sampling = pb.SamplingParams(max_tokens=2)

    def via_router(i: int) -> None:
        req = rpb.GenerateRequest(request_id=f"r{i}", prompt_ids=prompt, sampling=sampling)
        list(router.Generate(req))

    def direct(i: int) -> None:
        rid = f"x{i}"
        res = dec.Reserve(wpb.ReserveRequest(request_id=rid, prompt_ids=prompt, sampling=sampling))
        dest = wpb.Destination(worker_id=res.worker_id, block_ids=res.block_ids)
        pre.Prefill(
            wpb.PrefillRequest(
                request_id=rid, prompt_ids=prompt, sampling=sampling, destination=dest
            )
        )
        list(dec.Decode(wpb.DecodeRequest(request_id=rid, first_token_id=0)))

    n = args.grpc_requests
    return _time_calls(via_router, n), _time_calls(direct, n)


def _serve_router(conn) -> None:
    handle = run_router(0, RouterConfig(policy="prefix_aware", host="127.0.0.1"))
    conn.send(handle.address)
    conn.recv()
    handle.stop(grace=None)


def _serve_fakes(conn, router_address: str) -> None:
    p, d = FakeWorker(Role.PREFILL, "p0"), FakeWorker(Role.DECODE, "d0")
    p.register(router_address)
    d.register(router_address)
    conn.send((p.address, d.address))
    conn.recv()
    p.stop()
    d.stop()


def _time_calls(fn, n: int) -> list[float]:
    for i in range(min(20, n)):  # warm-up: channels, threads
        fn(-i - 1)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for row in run(args):
        print(json.dumps(row) if args.json else f"{row['label']:>8}: {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
