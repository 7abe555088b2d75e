"""The prefill worker process: engine + NIXL/UCX sender + PrefillWorker gRPC service."""

from __future__ import annotations

from baton.contract import Role
from baton.proto_gen import worker_pb2_grpc
from baton.worker.host import serve_until_signalled
from baton.worker.staged import rank_of
from prefill_worker.server import PrefillServicer
from prefill_worker.service import PrefillService
from prefill_worker.snapshots import SnapshotPulls


def attach(cfg, engine, loop, server, worker_id: str, host: str, secret=None,
           metrics=None) -> PrefillService:
    from transfer import SIDE_CHANNEL, make_sender, tp_identity

    fp, tp = tp_identity(engine.model.config, engine.pools.spec, *rank_of(engine.model),
                        weight_format=engine.weights and engine.weights.format,
                        cache_format=cfg.cache.cache_format)
    key = None if secret is None else secret.key(SIDE_CHANNEL)
    # PP stages or TP ranks: each process sends its own pools, rank / stage 0 drives the rest
    pipelined = cfg.worker.pipeline_parallel_size > 1 or cfg.worker.tensor_parallel_size > 1
    sender = make_sender(cfg.transfer, engine.pools.local if pipelined else engine.pools, fp, key,
                         tp)
    if pipelined:
        from prefill_worker.pipeline import PipelineSender
        from transfer.base import TransferEvent

        sender = PipelineSender(loop, sender, TransferEvent)
    service = PrefillService(loop, sender, worker_id,
                             layerwise=cfg.transfer.layerwise and not pipelined,
                             secret=secret, metrics=metrics)
    # PullSnapshot: decode-end state pulled back from decode workers
    service.snapshots = SnapshotPulls(service, secret)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(service), server)
    return service


def run(args) -> int:
    """`baton prefill-worker` (one stage of it with --pp-rank)."""
    from prefill_worker.pipeline import stage_handlers

    return serve_until_signalled(args, Role.PREFILL, attach,
                                 lambda cfg, secret, host: stage_handlers(cfg, secret))
