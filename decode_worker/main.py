"""The decode worker process: engine + NIXL/UCX receiver + DecodeWorker gRPC service."""

from __future__ import annotations

from baton.contract import Role
from baton.proto_gen import worker_pb2_grpc
from baton.worker.host import serve_until_signalled
from baton.worker.staged import rank_of
from decode_worker.server import DecodeServicer
from decode_worker.service import DecodeService
from decode_worker.ship import SnapshotHolds


def attach(cfg, engine, loop, server, worker_id: str, host: str, secret=None,
           metrics=None) -> DecodeService:
    from transfer import SIDE_CHANNEL, make_receiver, tp_identity

    fp, _ = tp_identity(engine.model.config, engine.pools.spec, *rank_of(engine.model),
                        weight_format=engine.weights and engine.weights.format,
                        cache_format=cfg.cache.cache_format)
    key = None if secret is None else secret.key(SIDE_CHANNEL)
    # PP stages or TP ranks: each process receives into its own pools (one endpoint each)
    pipelined = cfg.worker.pipeline_parallel_size > 1 or cfg.worker.tensor_parallel_size > 1
    receiver = make_receiver(cfg.transfer, engine.pools.local if pipelined else engine.pools, fp,
                             bind_host=host, key=key)
    if pipelined:
        from decode_worker.pipeline import PipelineReceiver
        from transfer.base import TransferEvent

        receiver = PipelineReceiver(loop, receiver, TransferEvent)
    service = DecodeService(loop, receiver, worker_id, cfg.transfer.lease_seconds, secret,
                            metrics)
    # HoldSnapshot: decode-end snapshots held for prefill workers to pull back
    service.shipper = SnapshotHolds(loop, receiver, worker_id, cfg.transfer.lease_seconds,
                                    secret)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(service), server)
    return service


def run(args) -> int:
    """`baton decode-worker` (one stage of it with --pp-rank)."""
    from decode_worker.pipeline import stage_handlers

    return serve_until_signalled(args, Role.DECODE, attach, stage_handlers)
