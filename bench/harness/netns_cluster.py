"""A Baton cluster with every role on its own host (network namespace), started with the CLI.

    NetnsCluster(net, model_dir, config, workdir)   router on host "router", then one
        worker per other host: "prefill*" -> `baton prefill-worker`, "decode*" ->
        `baton decode-worker`, each without --host (it finds its own address)
    .address                                        the router's gRPC address
    .metric(host, name)                             a worker's Prometheus sample
    .log_tails()                                    what each process printed, for failures

Every process runs the checkout these tests come from (PYTHONPATH, cwd) with the cluster
secret in `BATON_CLUSTER_TOKEN`, never on a command line.
"""

from __future__ import annotations

import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import grpc

from baton.auth import ENV_TOKEN, ClusterSecret
from baton.auth.grpc_auth import authorized
from baton.proto_gen import router_pb2, router_pb2_grpc
from bench.harness.netns import Network

ROOT = Path(__file__).resolve().parents[2]
ROUTER_PORT = 50051
METRICS_PORT = 9400
"""Fixed: each worker has a host of its own."""


class NetnsCluster:
    def __init__(self, net: Network, model: Path, config: Path, workdir: Path,
                 log_level: str = "WARNING"):
        self.net = net
        self.token = ClusterSecret.generate()
        self.secret = ClusterSecret(self.token)
        self.address = f"{net.hosts['router'].address}:{ROUTER_PORT}"
        self.logs: dict[str, Path] = {}
        self.procs = {}
        self._workdir = workdir
        base = [sys.executable, "-m", "baton.cli", "--log-level", log_level]
        self._start("router", [*base, "router", "--port", str(ROUTER_PORT),
                               "--host", net.hosts["router"].address, "--http-port", "0",
                               "--model", str(model), "--config", str(config)])
        for name in net.hosts:
            role = "prefill-worker" if name.startswith("prefill") else "decode-worker"
            if name != "router":
                self._start(name, [*base, role, "--router", self.address, "--model", str(model),
                                   "--config", str(config), "--metrics-port", str(METRICS_PORT)])

    def _start(self, host: str, argv: list[str]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env[ENV_TOKEN] = self.token
        env.setdefault("BATON_NUM_THREADS", "1")
        self.logs[host] = self._workdir / f"{host}.log"
        self.procs[host] = self.net.spawn(host, argv, env, self.logs[host], cwd=ROOT)

    def wait_ready(self, workers: int, timeout: float) -> list:
        """The router's worker list once `workers` registered; raises with the logs if a
        process died or time ran out."""
        deadline = time.monotonic() + timeout
        with authorized(grpc.insecure_channel(self.address), self.secret.bearer) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            while time.monotonic() < deadline:
                dead = [h for h, p in self.procs.items() if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"exited during start: {dead}\n{self.log_tails()}")
                try:
                    found = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=2).workers
                    if len(found) >= workers:
                        return list(found)
                except grpc.RpcError:
                    pass
                time.sleep(0.3)
        raise RuntimeError(f"{workers} workers not registered after {timeout:.0f} s\n"
                           f"{self.log_tails()}")

    def metric(self, host: str, name: str) -> float:
        """Sum of `name`'s samples on `host`'s worker (0 when it has none yet)."""
        url = f"http://{self.net.hosts[host].address}:{METRICS_PORT}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for host, path in self.logs.items():
            tail = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
            out.append(f"--- {host} ---\n" + "\n".join(tail))
        return "\n".join(out)
