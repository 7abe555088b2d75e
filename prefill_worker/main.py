"""The prefill worker process: engine + NIXL/UCX sender + PrefillWorker gRPC service."""

from __future__ import annotations

from baton.contract import Role
from baton.proto_gen import worker_pb2_grpc
from baton.worker.host import serve_until_signalled
from prefill_worker.server import PrefillServicer
from prefill_worker.service import PrefillService


def attach(cfg, engine, loop, server, worker_id: str, host: str, metrics) -> PrefillService:
    from transfer import compute_fingerprint, make_sender

    fp = compute_fingerprint(engine.model.config, engine.pools.spec)
    service = PrefillService(loop, make_sender(cfg.transfer, engine.pools, fp), worker_id,
                             metrics)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(service), server)
    return service


def run(args) -> int:
    """`baton prefill-worker`."""
    return serve_until_signalled(args, Role.PREFILL, attach)
