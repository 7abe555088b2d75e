"""Starts one worker process: engine, transfer endpoint, gRPC server, registration with the router."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.loop import EngineLoop
from baton.proto_gen import baton_pb2
from baton.worker.load import load_of
from baton.worker.registration import Registration
from baton.worker.snapshots import SnapshotEvents

log = logging.getLogger("baton.worker")

ROLE_PB = {"prefill": baton_pb2.WORKER_ROLE_PREFILL, "decode": baton_pb2.WORKER_ROLE_DECODE}


def run_worker_role(args, role: str) -> int:
    cfg = BatonConfig.load(args.config)
    host = args.host or cfg.worker.host
    worker = start_worker(cfg, role, args.router, args.model, host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"{role} worker {worker.worker_id} serving on {worker.address}", flush=True)
    stop.wait()
    worker.stop()
    return 0


class Worker:
    def __init__(self, worker_id, address, server, service, registration, loop):
        self.worker_id = worker_id
        self.address = address
        self.server = server
        self.service = service
        self.registration = registration
        self.loop = loop

    def stop(self) -> None:
        self.registration.stop()
        self.server.stop(grace=1).wait()
        self.service.close()
        self.loop.stop()


def start_worker(cfg: BatonConfig, role: str, router: str, model: str, host: str, port: int) -> Worker:
    from transfer import make_receiver, make_sender
    from transfer.fingerprint import compute_fingerprint

    engine = build_engine(cfg, model)
    events = SnapshotEvents(engine.cache)
    loop = EngineLoop(engine)
    fp = compute_fingerprint(engine.model.config, engine.pools.spec)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    bound = server.add_insecure_port(f"{host}:{port}")
    address = f"{host}:{bound}"
    worker_id = f"{role}-{socket.gethostname()}-{os.getpid()}-{bound}"
    if role == "prefill":
        from baton.proto_gen import worker_pb2_grpc
        from prefill_worker.server import PrefillServicer
        from prefill_worker.service import PrefillService

        service = PrefillService(loop, make_sender(cfg.transfer, engine.pools, fp), worker_id)
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(service), server)
    else:
        from baton.proto_gen import worker_pb2_grpc
        from decode_worker.server import DecodeServicer
        from decode_worker.service import DecodeService

        receiver = make_receiver(cfg.transfer, engine.pools, fp, bind_host=host)
        service = DecodeService(loop, receiver, worker_id, cfg.transfer.lease_seconds)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(service), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reg = Registration(
        router, worker_id, ROLE_PB[role], address, engine.pools.spec.tokens_per_block,
        load=lambda: load_of(loop), snapshot_events=events.drain,
    )
    reg.start()
    return Worker(worker_id, address, server, service, reg, loop)
