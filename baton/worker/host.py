"""Hosts one worker role in this process: engine loop, gRPC server, health, registration.

The role packages (`prefill_worker/main.py`, `decode_worker/main.py`) supply what differs:
their transfer endpoint, service and servicer, through `attach`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.auth import ClusterSecret, load_secret
from baton.auth.grpc_auth import ServerGuard
from baton.auth.tls import cluster_tls, router_channel_credentials
from baton.config import BatonConfig
from baton.config.ports import PortRange, port_range
from baton.contract import Role, WorkerInfo
from baton.engine.builder import build_engine
from baton.engine.engine import Engine
from baton.engine.loop import EngineLoop
from baton.worker.address import advertised_host, bind_grpc, interface_of, join_host_port
from baton.worker.exit import exit_now
from baton.worker.load import load_of
from baton.worker.metrics import WorkerMetrics
from baton.worker.registration import Registration
from baton.worker.snapshots import SnapshotEvents

log = logging.getLogger("baton.worker")

Attach = Callable[
    [BatonConfig, Engine, EngineLoop, grpc.Server, str, str, ClusterSecret | None, WorkerMetrics],
    object,
]
"""(config, engine, loop, server, worker_id, host, secret, metrics) -> the role's service (has
`close()`), its servicer already added to `server`."""


class Worker:
    def __init__(self, worker_id, address, server, service, registration, loop, metrics,
                 metrics_port):
        self.worker_id = worker_id
        self.address = address
        self.server = server
        self.service = service
        self.registration = registration
        self.loop = loop
        self.metrics = metrics
        self.metrics_port = metrics_port

    def stop(self) -> None:
        self.registration.stop()
        self.server.stop(grace=1).wait()
        self.service.close()
        self.metrics.stop()
        self.loop.stop()


def start_worker(cfg: BatonConfig, role: Role, attach: Attach, router: str, model: str,
                 host: str | None, ports: PortRange, metrics_port: int | None = None) -> Worker:
    """`host` None, "" or "auto": the address that routes to `router`; `metrics_port` None:
    the config's `worker.metrics_port`."""
    host = advertised_host(host, router)
    _pin_ucx_tcp(cfg, host)
    secret = load_secret(cfg.cluster, role=f"{role.value} worker")
    tls = cluster_tls(cfg.cluster)  # before the model loads: a bad file fails at once
    engine = build_engine(cfg, model)
    events = SnapshotEvents(engine.cache)
    loop = EngineLoop(engine)
    metrics = WorkerMetrics(role, loop)
    mport = metrics.serve(host, cfg.worker.metrics_port if metrics_port is None else metrics_port)
    # every worker service needs the cluster secret's bearer; health stays open
    tokens = None if secret is None else {secret.bearer}
    # no SO_REUSEPORT (gRPC's default): two workers on one host must not share a port of a range
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64),
                         interceptors=[ServerGuard(default=tokens)],
                         options=[("grpc.so_reuseport", 0)])
    bound = bind_grpc(server, host, ports, None if tls is None else tls.server_credentials())
    address = join_host_port(host, bound)
    worker_id = f"{role.value}-{socket.gethostname()}-{os.getpid()}-{bound}"
    service = attach(cfg, engine, loop, server, worker_id, host, secret, metrics)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    info = WorkerInfo(worker_id, role, address, engine.pools.spec.tokens_per_block,
                      max_model_len=engine.max_model_len)
    reg = Registration(router, info, load=lambda: load_of(loop), snapshot_events=events.drain,
                       bearer=None if secret is None else secret.bearer,
                       credentials=router_channel_credentials(cfg.router, tls))
    reg.start()
    return Worker(worker_id, address, server, service, reg, loop, metrics, mport)


def _pin_ucx_tcp(cfg: BatonConfig, host: str) -> None:
    """Over TCP alone (`transfer.ucx_tls: tcp`), UCX uses only the advertised address's
    interface: by default it listens on every one, loopback too, and could take loopback
    towards a peer that merely looks local (another container or namespace of this kernel).
    An operator's own UCX_NET_DEVICES wins."""
    device = interface_of(host) if cfg.transfer.tcp_only else None
    if device is not None:
        os.environ.setdefault("UCX_NET_DEVICES", device)


def serve_until_signalled(args, role: Role, attach: Attach) -> int:
    """`baton prefill-worker` / `baton decode-worker`: start, print the address, wait for a
    signal, stop."""
    cfg = BatonConfig.load(args.config)
    ports = cfg.worker.ports if args.port is None else port_range(args.port, "--port")
    worker = start_worker(cfg, role, attach, args.router, args.model, args.host or cfg.worker.host,
                          ports, getattr(args, "metrics_port", None))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"{role.value} worker {worker.worker_id} serving on {worker.address}, metrics on "
          f"http://{worker.address.rpartition(':')[0]}:{worker.metrics_port}/metrics", flush=True)
    stop.wait()
    worker.stop()
    exit_now(0)
