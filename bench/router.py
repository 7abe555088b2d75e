"""Router benchmark: routing decisions per second and the latency the router adds per request.

    python -m bench.router --json [--prefixes 10000] [--prompt-len 1024] [--requests 2000]

Three measurements:
  decision  policy.choose (prompt hashing + index lookups) plus the registry read, with the
            prefix_aware index holding `--prefixes` snapshot prefixes over 8 + 8 workers.
  grpc      Generate through a router process (max_tokens=2) against instant fake workers
            in a third process, versus the client making the same Reserve + Prefill + Decode
            calls itself: the difference is the router's added latency, one more gRPC hop
            included (target: < 1 ms p50).
  stream    `--streams` concurrent Generate streams through one router process, each request
            `--stream-tokens` long, from a fake decode worker that makes a token per stream
            every `--step-ms` and sends what is ready in one message, as the decode worker
            does: tokens/s the clients receive (target: >= 20,000 with 64 streams), the
            router's CPU time per token (/proc), and the same clients reading the fake
            workers directly (what this machine allows without the router).
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
import threading
import time
from contextlib import contextmanager

import grpc

from baton.config.router import RouterConfig
from baton.contract import Role, SnapshotEvent, WorkerInfo, WorkerLoad
from baton.contract.prefix_hash import snapshot_key
from baton.model.tokenizer import ByteTokenizer
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import router_pb2_grpc as rgrpc
from baton.proto_gen import worker_pb2 as wpb
from baton.proto_gen import worker_pb2_grpc as wgrpc
from bench.common import cpu_seconds
from bench.harness.fake_workers import FakeWorker, Script
from router.policies import RouteRequest, make_policy
from router.registry import Registry
from router.server import run_router

TARGET_P50_MS = 1.0
TARGET_TOKENS_PER_S = 20_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.router", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one JSON object a measurement")
    p.add_argument("--prefixes", type=int, default=10_000, help="snapshot prefixes tracked")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--requests", type=int, default=2000, help="routing decisions timed")
    p.add_argument("--grpc-requests", type=int, default=300, help="Generate calls timed")
    p.add_argument("--streams", type=int, default=64, help="concurrent Generate streams")
    p.add_argument("--stream-tokens", type=int, default=512, help="max_tokens per stream")
    p.add_argument("--step-ms", type=float, default=2.0,
                   help="fake decode engine step: a token per stream this often")
    p.add_argument("--stream-seconds", type=float, default=6.0, help="streaming window")
    p.add_argument("--no-drain", action="store_true",
                   help="fake decode sends one token a message (the decode worker before)")
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
        opts.stream_seconds = min(opts.stream_seconds, 3.0)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # quiets GOAWAY notes at child shutdown
    return [_decision(opts), _grpc(opts), _stream(opts)]


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


@contextmanager
def _processes(decode: Script, prefill: Script):
    """A router process (with the tiny model's tokenizer) and a fake-workers process:
    yields (router address, prefill address, decode address, {process name: pid})."""
    ctx = multiprocessing.get_context("spawn")
    router_conn, router_child = ctx.Pipe()
    workers_conn, workers_child = ctx.Pipe()
    procs = [ctx.Process(target=_serve_router, args=(router_child,), daemon=True)]
    procs[0].start()
    router_address = router_conn.recv()
    procs.append(ctx.Process(target=_serve_fakes, args=(workers_child, router_address, decode,
                                                        prefill), daemon=True))
    procs[1].start()
    p_address, d_address = workers_conn.recv()
    try:
        pids = {"router": procs[0].pid, "fake workers": procs[1].pid, "client": os.getpid()}
        yield router_address, p_address, d_address, pids
    finally:
        for conn in (router_conn, workers_conn):
            conn.send("stop")
        for proc in procs:
            proc.join(10)


def _grpc(args: argparse.Namespace) -> dict:
    with _processes(Script(), Script()) as (*addresses, _):
        channels = [grpc.insecure_channel(a) for a in addresses]
        try:
            routed, baseline = _time_both(args, *channels)
        finally:
            for ch in channels:
                ch.close()
    r, b = _percentiles(routed), _percentiles(baseline, "baseline_")
    added = round(r["p50_ms"] - b["baseline_p50_ms"], 4)
    return {
        "benchmark": "router",
        "label": "grpc",
        "policy": "prefix_aware",
        "prompt_len": args.prompt_len,
        "requests": args.grpc_requests,
        "processes": "client, router, fake workers",
        "router_tokenizer": "bytes (the tiny model's)",
        **r,
        "baseline": "client calls Reserve + Prefill + Decode itself",
        **b,
        "added_p50_ms": added,
        "ratio": round(r["p50_ms"] / b["baseline_p50_ms"], 3),
        "ratio_note": "p50 through the router / p50 of the direct calls",
        "target_p50_ms": TARGET_P50_MS,
        "meets_target": added < TARGET_P50_MS,
    }


def _stream(args: argparse.Namespace) -> dict:
    threads = args.streams + 16
    decode = Script(step_s=args.step_ms / 1000, drain=not args.no_drain, server_threads=threads)
    with _processes(decode, Script(server_threads=threads)) as (r_addr, p_addr, d_addr, pids):
        with grpc.insecure_channel(r_addr) as ch:
            router = rgrpc.RouterStub(ch)
            routed = _stream_load(args, lambda rid: _via_router(router, args, rid), pids)
        with grpc.insecure_channel(p_addr) as pch, grpc.insecure_channel(d_addr) as dch:
            stubs = wgrpc.PrefillWorkerStub(pch), wgrpc.DecodeWorkerStub(dch)
            pids.pop("router")
            direct = _stream_load(args, lambda rid: _direct(*stubs, args, rid), pids)
    rate = routed["tokens"] / routed["wall_s"]
    return {
        "benchmark": "router",
        "label": "stream",
        "processes": "client (one thread a stream), router, fake workers",
        "streams": args.streams,
        "stream_tokens": args.stream_tokens,
        "fake_decode": f"a token per stream every {args.step_ms} ms, "
        + ("every ready token in one message" if not args.no_drain else "one token a message"),
        "offered_tokens_per_s": round(args.streams * 1000 / args.step_ms),
        "streamed_tokens_per_s": round(rate),
        "messages_per_s": round(routed["messages"] / routed["wall_s"]),
        "tokens_per_message": round(routed["tokens"] / max(1, routed["messages"]), 2),
        "router_cpu_s": routed["cpu_s"]["router"],
        "router_cpu_us_per_token": round(
            routed["cpu_s"]["router"] / max(1, routed["tokens"]) * 1e6, 2
        ),
        "cores_busy": _busy(routed),
        "cores_busy_note": f"share of a core each process used; this machine has "
                           f"{len(os.sched_getaffinity(0))} for all three",
        "text_equals_full_decode": routed["text_ok"],
        "baseline": "the same clients calling the fake workers directly (no router)",
        "baseline_tokens_per_s": round(direct["tokens"] / direct["wall_s"]),
        "baseline_tokens_per_message": round(direct["tokens"] / max(1, direct["messages"]), 2),
        "baseline_cores_busy": _busy(direct),
        "target_tokens_per_s": TARGET_TOKENS_PER_S,
        "ratio": round(rate / TARGET_TOKENS_PER_S, 3),
        "ratio_note": "streamed tokens/s through the router / target (>= 1 meets it)",
        "meets_target": rate >= TARGET_TOKENS_PER_S,
    }


def _via_router(router, args, rid: str) -> tuple[list[int], str, int]:
    prompt = list(range(3, 3 + 16))
    req = rpb.GenerateRequest(request_id=rid, prompt_ids=prompt,
                              sampling=pb.SamplingParams(max_tokens=args.stream_tokens))
    ids, text, messages = [], [], 0
    for msg in router.Generate(req, timeout=120):
        ids.extend(msg.token_ids)
        text.append(msg.text)
        messages += 1
    return ids, "".join(text), messages


def _direct(pre, dec, args, rid: str) -> tuple[list[int], None, int]:
    prompt = list(range(3, 3 + 16))
    sampling = pb.SamplingParams(max_tokens=args.stream_tokens)
    res = dec.Reserve(wpb.ReserveRequest(request_id=rid, prompt_ids=prompt, sampling=sampling))
    dest = wpb.Destination(worker_id=res.worker_id, block_ids=res.block_ids)
    first = pre.Prefill(iter([wpb.PrefillRequest(  # a stream of one: destination included
        request_id=rid, prompt_ids=prompt, sampling=sampling, destination=dest)])).first_token_id
    ids, messages = [first], 1
    for msg in dec.Decode(wpb.DecodeRequest(request_id=rid, first_token_id=first), timeout=120):
        ids.extend(msg.token_ids)
        messages += 1
    return ids, None, messages


def _busy(totals: dict) -> dict[str, float]:
    return {name: round(cpu / totals["wall_s"], 2) for name, cpu in totals["cpu_s"].items()}


def _stream_load(args, call, pids: dict[str, int]) -> dict:
    """`args.streams` threads each run requests back to back for `args.stream_seconds`."""
    tok, lock = ByteTokenizer(), threading.Lock()
    totals = {"tokens": 0, "messages": 0, "text_ok": True}
    errors: list[BaseException] = []
    deadline = time.perf_counter() + args.stream_seconds

    def client(i: int) -> None:
        n = 0
        while time.perf_counter() < deadline and not errors:
            try:
                ids, text, messages = call(f"s{i}-{n}")
            except BaseException as e:  # noqa: BLE001 - re-raised below: a failed bench fails
                errors.append(e)
                return
            n += 1
            with lock:
                totals["tokens"] += len(ids)
                totals["messages"] += messages
                if text is not None and (text != tok.decode(ids) or len(ids) != args.stream_tokens):
                    totals["text_ok"] = False

    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    totals["wall_s"] = time.perf_counter() - t0
    totals["cpu_s"] = {name: round(cpu_seconds(pid) - cpu0[name], 3) for name, pid in pids.items()}
    if errors:
        raise RuntimeError(f"{len(errors)} of {args.streams} streams failed: {errors[0]!r}")
    if not totals["text_ok"]:
        raise AssertionError("streamed text differs from the full decode of the streamed tokens")
    return totals


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
        pre.Prefill(iter([  # a stream of one message: the destination is already known
            wpb.PrefillRequest(
                request_id=rid, prompt_ids=prompt, sampling=sampling, destination=dest
            )
        ]))
        list(dec.Decode(wpb.DecodeRequest(request_id=rid, first_token_id=0)))

    n = args.grpc_requests
    return _time_calls(via_router, n), _time_calls(direct, n)


def _serve_router(conn) -> None:
    handle = run_router(0, RouterConfig(policy="prefix_aware", host="127.0.0.1"),
                        tokenizer=ByteTokenizer())
    conn.send(handle.address)
    conn.recv()
    handle.stop(grace=None)


def _serve_fakes(conn, router_address: str, decode: Script, prefill: Script) -> None:
    p, d = FakeWorker(Role.PREFILL, "p0", prefill), FakeWorker(Role.DECODE, "d0", decode)
    p.register(router_address)
    d.register(router_address)
    conn.send((p.address, d.address))
    while not conn.poll(1.0):  # heartbeats, or the router ejects them after 5 s
        p.heartbeat()
        d.heartbeat()
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
