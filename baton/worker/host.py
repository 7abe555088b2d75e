"""Hosts one worker role in this process: engine loop, gRPC server, health, registration.

The role packages (`prefill_worker/main.py`, `decode_worker/main.py`) supply what differs:
their transfer endpoint, service and servicer, through `attach`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.auth import ClusterSecret, load_secret
from baton.auth.grpc_auth import ServerGuard
from baton.auth.tls import cluster_tls, router_channel_credentials
from baton.config import BatonConfig
from baton.config.ports import PortRange, port_range
from baton.contract import Role, StageInfo, WorkerInfo
from baton.engine.builder import build_engine
from baton.engine.engine import Engine
from baton.engine.loop import EngineLoop
from baton.errors import ConfigError
from baton.worker.address import advertised_host, bind_grpc, interface_of, join_host_port
from baton.worker.exit import STOP_BUDGET_S, StopSignals, exit_now, timed_stop
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

    def stop(self, budget_s: float | None = None) -> None:
        """Stop serving; `budget_s` (see `timed_stop`): how long the stop may take."""
        phases = [
            ("deregister", self.registration.stop),
            ("grpc server", lambda: self.server.stop(grace=1).wait()),
            ("service", self.service.close),
            ("metrics", self.metrics.stop),
            ("engine loop", self.loop.stop),
        ]
        model = self.loop.engine.model
        if model.capabilities.staged:  # a pipeline's other stages stop with stage 0
            phases.append(("model", model.close))
        timed_stop(f"worker {self.worker_id}", phases, budget_s)


def start_worker(cfg: BatonConfig, role: Role, attach: Attach, router: str, model: str,
                 host: str | None, ports: PortRange, metrics_port: int | None = None,
                 pp_master: str | None = None) -> Worker:
    """`host` None, "" or "auto": the address that routes to `router`; `metrics_port` None:
    the config's `worker.metrics_port`. With `worker.pipeline_parallel_size` > 1 this is
    stage 0: it starts the other stages (`baton <role>-worker --pp-rank R`) unless
    `pp_master` says they are started elsewhere and meet at that HOST:PORT. With
    `worker.tensor_parallel_size` > 1 this is rank 0: it starts ranks 1..N-1 the same way
    (`--pp-rank R` names the TP rank then), each with its own transfer agent."""
    w = cfg.worker
    if router.rpartition(":")[2] == "0":  # it would retry registering there for ever
        raise ConfigError(f"--router {router}: port 0 is no router's address (give its port)")
    if w.tensor_parallel_size > 1 and pp_master is not None:
        raise ConfigError(f"worker.tensor_parallel_size={w.tensor_parallel_size}: the ranks "
                          "start on this host (no --pp-master with tensor parallelism)")
    host = advertised_host(host, router)
    _pin_ucx_tcp(cfg, host)
    secret = load_secret(cfg.cluster, role=f"{role.value} worker")
    tls = cluster_tls(cfg.cluster)  # before the model loads: a bad file fails at once
    engine = build_engine(cfg, model, stage_argv=_stage_argv(role, router, model, host),
                          on_stage_death=_stage_died, pp_master=pp_master,
                          on_link_lost=_stage_link_lost)
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
                      max_model_len=engine.max_model_len, stages=_stages(engine, service))
    reg = Registration(router, info, load=lambda: load_of(loop), snapshot_events=events.drain,
                       bearer=None if secret is None else secret.bearer,
                       credentials=router_channel_credentials(cfg.router, tls))
    reg.start()
    return Worker(worker_id, address, server, service, reg, loop, metrics, mport)


def _stages(engine: Engine, service) -> tuple[StageInfo, ...]:
    """Every stage's layers and (decode workers) transfer side channel, for the registration
    (a tensor-parallel worker: one stage, every rank's side channel, comma-separated)."""
    model = engine.model
    layers = model.layers if model.capabilities.staged else [range(model.config.num_layers)]
    receiver = getattr(service, "receiver", None)
    endpoints = receiver.endpoint.split(",") if receiver is not None else [""] * len(layers)
    if len(endpoints) != len(layers):  # TP ranks: every side channel on the first entry
        endpoints = [",".join(endpoints)] + [""] * (len(layers) - 1)
    return tuple(StageInfo(r.start, len(r), ep) for r, ep in zip(layers, endpoints, strict=True))


def _stage_argv(role: Role, router: str, model: str, host: str):
    from baton.model.registry import resolve_model

    path = str(resolve_model(model))
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return lambda rank, master: [
        sys.executable, "-m", "baton.cli", "--log-level", level, f"{role.value}-worker",
        "--router", router,
        "--model", path, "--host", host, "--pp-rank", str(rank), "--pp-master", master]


def _stage_died(rank: int, code: int) -> None:
    """A stage of this worker is gone: the worker cannot compute any more. Leave at once, so
    the router ejects it and retries its requests elsewhere (the other stages were killed)."""
    log.error("pipeline stage %d exited (%s): this worker stops serving", rank, code)
    exit_now(1)


def _stage_link_lost(error: BaseException) -> None:
    """A message to or from another stage failed (it died, wherever it ran): as above."""
    log.error("pipeline stage link lost (%s): this worker stops serving", error)
    exit_now(1)


def _worker_config(args, role: Role) -> BatonConfig:
    """The config file (or, in a stage that stage 0 started, stage 0's own config) with the
    role's section (`prefill:` / `decode:`) over `worker`, and `--pipeline-parallel-size`
    over `worker.pipeline_parallel_size`."""
    from baton.engine.pipeline.launch import config_from_env

    cfg = config_from_env(args.config).for_role(role.value)
    for key in ("pipeline_parallel_size", "tensor_parallel_size"):
        size = getattr(args, key, None)
        if size is not None and size != getattr(cfg.worker, key):
            cfg = dataclasses.replace(cfg, worker=dataclasses.replace(cfg.worker, **{key: size}))
    k = getattr(args, "speculative_tokens", None)
    if k is not None:  # that key alone: the file's max_batch and tree stay
        cfg = dataclasses.replace(cfg, speculative=cfg.speculative.with_draft_tokens(k))
    if getattr(args, "quantize", None):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, quantize=args.quantize))
    if getattr(args, "quantize_activations", None):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, quantize_activations=args.quantize_activations))
    return cfg


def _pin_ucx_tcp(cfg: BatonConfig, host: str) -> None:
    """Over TCP alone (`transfer.ucx_tls: tcp`), UCX uses only the advertised address's
    interface: by default it listens on every one, loopback too, and could take loopback
    towards a peer that merely looks local (another container or namespace of this kernel).
    An operator's own UCX_NET_DEVICES wins."""
    device = interface_of(host) if cfg.transfer.tcp_only else None
    if device is not None:
        os.environ.setdefault("UCX_NET_DEVICES", device)


def serve_until_signalled(args, role: Role, attach: Attach, stage_handlers=None) -> int:
    """`baton prefill-worker` / `baton decode-worker`: start, print the address, wait for a
    signal, stop. With `--pp-rank R` (R > 0) run only that pipeline stage:
    `stage_handlers(cfg, secret, host)` makes its transfer agent's control handlers."""
    cfg = _worker_config(args, role)
    rank = getattr(args, "pp_rank", None)
    if rank:
        from baton.engine.pipeline.launch import serve_stage
        from baton.model.registry import resolve_model

        if not args.pp_master:
            raise ConfigError("--pp-rank needs --pp-master HOST:PORT (stage 0's rendezvous)")
        host = advertised_host(args.host or cfg.worker.host, args.router)
        _pin_ucx_tcp(cfg, host)
        secret = load_secret(cfg.cluster, role=f"{role.value} worker stage {rank}")
        make = None if stage_handlers is None else stage_handlers(cfg, secret, host)
        if cfg.worker.tensor_parallel_size > 1 and cfg.worker.pipeline_parallel_size > 1:
            from baton.engine.tp.pipeline import serve  # a world rank of TP x PP

            exit_now(serve(cfg, resolve_model(args.model), rank, args.pp_master, make))
        if cfg.worker.tensor_parallel_size > 1:  # a rank of this worker's TP group
            from baton.engine.tp.launch import serve_rank

            exit_now(serve_rank(cfg, resolve_model(args.model), rank, args.pp_master, make))
        exit_now(serve_stage(cfg, resolve_model(args.model), rank, args.pp_master, make))
    ports = cfg.worker.ports if args.port is None else port_range(args.port, "--port")
    worker = start_worker(cfg, role, attach, args.router, args.model, args.host or cfg.worker.host,
                          ports, getattr(args, "metrics_port", None),
                          pp_master=args.pp_master if rank == 0 else None)
    stop = StopSignals()
    model = worker.loop.engine.model
    layout = model.rank_layout if model.capabilities.staged else None
    if layout:  # tensor parallelism: what every rank process holds
        print(layout, flush=True)
    print(f"{role.value} worker {worker.worker_id} serving on {worker.address}, metrics on "
          f"http://{worker.address.rpartition(':')[0]}:{worker.metrics_port}/metrics", flush=True)
    stop.wait()
    worker.stop(STOP_BUDGET_S)
    exit_now(0)
