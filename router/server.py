"""The router process's gRPC edge: baton.v1.Router, baton.v1.Registry and grpc.health.v1.

Protobuf stops here (and in worker_client.py); everything behind is plain dataclasses.
`run_router(port, config, tokenizer, secret, api_keys)` starts a server and returns a handle
with `stop()`. With a cluster secret, Registry calls must carry its bearer; with API keys,
Router calls must carry one of them (or the cluster bearer); health is always open.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from concurrent import futures
from dataclasses import dataclass, replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.auth import ClusterSecret
from baton.auth.grpc_auth import ServerGuard
from baton.auth.tls import ClusterTls, router_server_credentials, router_tls
from baton.config.router import RouterConfig
from baton.contract import wire
from baton.contract.status import abort_with, details_of, status_of
from baton.errors import InvalidRequestError, NotPermittedError
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import router_pb2_grpc as rgrpc
from baton.worker import phases
from router.cancellation import Cancellation
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator, Tokenizer
from router.policies import RoutingPolicy, make_policy
from router.registry import Registry
from router.worker_client import WorkerClients

log = logging.getLogger(__name__)
SERVICES = ("baton.v1.Router", "baton.v1.Registry")


class RouterServicer(rgrpc.RouterServicer):
    def __init__(self, orchestrator: Orchestrator, metrics: RouterMetrics):
        self._orch = orchestrator
        self._metrics = metrics

    def Generate(self, request, context):
        cancel = Cancellation()
        context.add_callback(cancel.cancel)
        stream = None
        try:
            stream = self._metrics.track(
                self._orch.generate(wire.generate_from_pb(request), cancel), "grpc")
            for chunk in stream:
                if chunk.summary is not None and chunk.summary.phases_ms:
                    context.set_trailing_metadata(phases.to_metadata(chunk.summary.phases_ms))
                yield wire.chunk_to_pb(chunk)
        except Exception as e:
            code = status_of(e)
            if code is None:
                log.exception("Generate %s failed", request.request_id)
                code = grpc.StatusCode.INTERNAL
            context.abort(code, details_of(e))
        finally:
            if stream is not None:
                stream.close()

    def ListWorkers(self, request, context):
        try:
            role = None if request.role == pb.WORKER_ROLE_UNSPECIFIED else \
                wire.role_from_pb(request.role)
        except InvalidRequestError as e:
            abort_with(context, e)
        policy = self._orch.policy
        views = self._orch.registry.workers(role)
        return rpb.ListWorkersReply(
            workers=[
                wire.worker_view_to_pb(
                    replace(v, tracked_snapshots=policy.tracked_snapshots(v.worker_id))
                )
                for v in views
            ]
        )


class RegistryServicer(rgrpc.RegistryServicer):
    def __init__(self, registry: Registry, config: RouterConfig):
        self._registry = registry
        self._config = config

    def Register(self, request, context):
        try:
            self._registry.register(wire.register_from_pb(request))
        except (InvalidRequestError, NotPermittedError) as e:
            abort_with(context, e)
        log.info(
            "worker %s (%s) registered at %s", request.worker_id, request.role, request.address
        )
        return rpb.RegisterReply(
            heartbeat_seconds=self._config.heartbeat_seconds,
            eject_after_seconds=self._config.eject_after_seconds,
        )

    def Heartbeat(self, request, context):
        try:
            events = [wire.event_from_pb(e) for e in request.snapshot_events]
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, details_of(e))
        known = self._registry.heartbeat(request.worker_id, wire.load_from_pb(request.load), events)
        return rpb.HeartbeatReply(reregister=not known)

    def Deregister(self, request, context):
        return rpb.DeregisterReply(found=self._registry.deregister(request.worker_id))


@dataclass
class RouterHandle:
    """A running router: its port, its parts (for tests and the CLI) and `stop()`."""

    port: int
    server: grpc.Server
    registry: Registry
    policy: RoutingPolicy
    orchestrator: Orchestrator
    health: health.HealthServicer
    _clients: WorkerClients
    _stop_event: threading.Event
    metrics: RouterMetrics

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, grace: float | None = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self._stop_event.set()
        self.server.stop(grace).wait()
        self._clients.close()

    def wait(self) -> None:
        self.server.wait_for_termination()


def run_router(
    port: int, config: RouterConfig | None = None, tokenizer: Tokenizer | None = None,
    secret: ClusterSecret | None = None, api_keys: frozenset[str] = frozenset(),
    cluster_tls: ClusterTls | None = None,
) -> RouterHandle:
    """Starts the router on `port` (0 = pick a free one) and returns at once. TLS: the port
    serves `config.tls_cert_file` if set, else mutual TLS under `cluster_tls` if given
    (baton/auth/tls.py); channels to workers are mutual TLS with `cluster_tls`."""
    config = config or RouterConfig()
    policy = make_policy(config)
    registry = Registry(config.eject_after_seconds, listeners=[policy])
    bearer = secret.bearer if secret is not None else None
    public = router_tls(config)  # a bad file fails here, before anything listens
    clients = WorkerClients(config, bearer,
                            None if cluster_tls is None else cluster_tls.channel_credentials())
    registry.on_remove.append(clients.drop)
    registry.on_eject.append(clients.eject)
    orch = Orchestrator(config, registry, policy, clients, tokenizer)
    # a dead worker leaves the registry at once, and the prefills working for it end now
    clients.on_lost.append(lambda worker_id, why: registry.lost(worker_id))
    clients.on_lost.append(lambda worker_id, why: orch.peers.lost(worker_id))
    metrics = RouterMetrics(registry, orch.paths,
                            tracked=lambda: {**orch.tracked(), **clients.calls.snapshot()})

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.server_threads),
                         interceptors=[_guard(bearer, api_keys)])
    rgrpc.add_RouterServicer_to_server(RouterServicer(orch, metrics), server)
    rgrpc.add_RegistryServicer_to_server(RegistryServicer(registry, config), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    credentials = router_server_credentials(public, cluster_tls)
    address = f"{config.host}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else \
        server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"router could not bind {config.host}:{port}; pick another router port")
    if not api_keys and not _is_loopback(config.host):
        log.warning(
            "the router listens on %s without API keys: anyone who reaches port %d can run "
            "requests; set router.api_keys_file or BATON_API_KEY, or router.host: 127.0.0.1",
            config.host, bound,
        )
    server.start()
    for name in ("", *SERVICES):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    stop_event = threading.Event()
    threading.Thread(
        target=_eject_loop, args=(registry, config, stop_event), name="router-eject", daemon=True
    ).start()
    log.info("router serving on port %d (policy %s, %s)", bound, config.policy,
             "TLS" if public else "mutual TLS" if cluster_tls else "plaintext")
    return RouterHandle(bound, server, registry, policy, orch, health_servicer, clients, stop_event,
                        metrics)


def _guard(bearer: str | None, api_keys: frozenset[str]) -> ServerGuard:
    cluster = None if bearer is None else {bearer}
    public = None if not api_keys else {*api_keys, *(cluster or ())}
    return ServerGuard(
        tokens={"baton.v1.Registry": cluster, "baton.v1.Router": public},
        hints={"baton.v1.Router": "an API key (router.api_keys_file or BATON_API_KEY)"},
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _eject_loop(registry: Registry, config: RouterConfig, stop: threading.Event) -> None:
    period = max(0.05, min(config.heartbeat_seconds, config.eject_after_seconds) / 2)
    while not stop.wait(period):
        for worker_id in registry.eject_stale():
            log.warning(
                "worker %s ejected: silent for over %.1fs", worker_id, config.eject_after_seconds
            )
