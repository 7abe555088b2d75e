"""`baton bench e2e --hosts netns`: the e2e workload with every role on its own host.

Router, one prefill and one decode host, each a network namespace on one bridge
(bench/harness/netns.py), KV over UCX TCP (`transfer.ucx_tls: tcp`; between namespaces UCX
would otherwise copy with cma). The prefill host's link (the KV's way out) is shaped with
`tc tbf` to each rate in RATES (after a warm-up run; every rate on sessions of its own, whose
prompts no earlier run cached); per rate: throughput, TTFT and ITL p50/p99, bytes per request
the prefill host sent on its link and the handoff bytes the workers counted. The same runs
with `transfer.layerwise` on show how much of the transfer layer-wise streaming hides
(TTFT whole vs layer-wise at the same rate). Needs root and `ip`; says why not otherwise.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench.common import checkpoint

RATES = ("unlimited", "1gbit", "100mbit")


def _config(layerwise: bool) -> dict:
    from bench.e2e import CONFIG

    return {**CONFIG, "router": {**CONFIG["router"], "heartbeat_seconds": 0.5},
            "transfer": {"ucx_tls": "tcp", "layerwise": layerwise, "lease_seconds": 60}}


def _run_rate(net, cluster, wl, rate: str, tag: str, first: int) -> dict:
    """The workload's sessions `first`.. (prompts no earlier run saw) at `rate`."""
    import grpc

    from baton.client.remote import to_pb
    from baton.client.requests import RequestSpec
    from baton.engine.request import SamplingParams
    from baton.proto_gen import router_pb2_grpc
    from bench.e2e import run_sessions, summarize

    net.rate_limit("prefill0", None if rate == "unlimited" else rate)
    sp = SamplingParams(max_tokens=wl.answer_len, ignore_eos=True)
    sent0 = net.tx_bytes("prefill0")
    moved0 = cluster.metric("prefill0", "baton_handoff_bytes_sum")
    with grpc.insecure_channel(cluster.address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)

        def submit(rid, ids, session):
            spec = RequestSpec(f"{tag}-{rid}", prompt_ids=ids, session=session, sampling=sp)
            for msg in stub.Generate(to_pb(spec), timeout=600):
                yield list(msg.token_ids), time.perf_counter()

        t0 = time.perf_counter()
        recs = run_sessions(submit, wl, list(range(first, first + wl.sessions)))
        wall = time.perf_counter() - t0
    n = len(recs)
    wire = net.tx_bytes("prefill0") - sent0
    moved = cluster.metric("prefill0", "baton_handoff_bytes_sum") - moved0
    return {**summarize(f"netns {rate}", recs, wall), "link_rate": rate,
            "wire_bytes_per_request": round(wire / n), "handoff_bytes_per_request": round(moved / n)}


def run(args) -> list[dict]:
    import yaml

    from bench.e2e import _workload
    from bench.harness.netns import Network, unavailable
    from bench.harness.netns_cluster import NetnsCluster

    reason = unavailable()
    if reason:
        raise RuntimeError(f"bench e2e --hosts netns cannot run here: {reason}")
    wl = _workload(getattr(args, "quick", False))
    path = checkpoint("tiny")
    os.environ.setdefault("BATON_NUM_THREADS", "1")
    rows = []
    for layerwise in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "e2e.yaml"
            cfg.write_text(yaml.safe_dump(_config(layerwise)))
            net = Network(["router", "prefill0", "decode0"])
            try:
                cluster = NetnsCluster(net, Path(path), cfg, Path(tmp))
                cluster.wait_ready(2, timeout=180)
                # warm-up (first contacts, UCX wire-up), not counted; then every rate on
                # sessions of its own, so no prefix is cached from an earlier rate
                _run_rate(net, cluster, wl, "unlimited", "warmup", 10_000)
                for i, rate in enumerate(RATES):
                    row = _run_rate(net, cluster, wl, rate, f"{rate}-{int(layerwise)}",
                                    (i + 1) * 1000)
                    row.update(benchmark="e2e", label=f"netns {rate} "
                               f"{'layer-wise' if layerwise else 'whole'}",
                               layerwise=layerwise, sessions=wl.sessions, turns=wl.turns)
                    rows.append(row)
            finally:
                net.close()
    whole = {r["link_rate"]: r for r in rows if not r["layerwise"]}
    for r in rows:
        if r["layerwise"]:
            w = whole[r["link_rate"]]
            r["ttft_p50_hidden_ms"] = round(w["ttft_p50_ms"] - r["ttft_p50_ms"], 2)
            r["ratio"] = round(r["ttft_p50_ms"] / w["ttft_p50_ms"], 3) if w["ttft_p50_ms"] else None
            r["ratio_note"] = "layer-wise TTFT p50 / whole-request TTFT p50 at the same link rate"
    return rows
