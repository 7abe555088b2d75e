"""gRPC face of the prefill worker: protobuf stops here."""

from __future__ import annotations

import logging

import grpc

from baton.contract import Role, wire
from baton.contract.status import abort_with
from baton.errors import BatonError
from baton.proto_gen import baton_pb2, worker_pb2, worker_pb2_grpc
from baton.worker import phases
from baton.worker.load import counters_of, load_of, tracked_counters
from prefill_worker.service import PrefillService

log = logging.getLogger("baton.prefill")


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, service: PrefillService):
        self.service = service

    def Prefill(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Prefill stream carried no request")
        try:
            inp = wire.prefill_from_pb(first)
        except (BatonError, ValueError) as e:  # a malformed prompt: nothing was started
            abort_with(context, e)
        # runs when the RPC ends: a no-op after success, frees the request if the router cancelled
        context.add_callback(lambda: self.service.abort(inp.request_id))

        def destination():
            # the router sends it once its Reserve returned; the compute runs meanwhile
            msg = next(request_iterator, None)
            return None if msg is None else wire.destination_from_pb(msg)

        try:
            result = self.service.prefill(inp, destination)
            context.set_trailing_metadata(phases.to_metadata(result.phases_ms))
            return wire.prefill_result_to_pb(result)
        except (BatonError, ValueError, grpc.RpcError) as e:
            log.warning("prefill %.80r failed: %s", inp.request_id, e)
            abort_with(context, e)

    def PullSnapshot(self, request, context):
        try:
            n = self.service.snapshots.pull(wire.shipment_from_pb(request))
            return worker_pb2.PullSnapshotReply(blocks_pulled=n)
        except (BatonError, ValueError) as e:
            log.info("pull snapshot %s: %s", request.request_id, e)
            abort_with(context, e)

    def Abort(self, request, context):
        if request.HasField("sample"):  # a prefill worker holds no sample past its first token
            return baton_pb2.AbortReply(found=False)
        return baton_pb2.AbortReply(found=self.service.abort(request.request_id))

    def Stats(self, request, context):
        return baton_pb2.StatsReply(
            worker_id=self.service.worker_id, role=wire.role_to_pb(Role.PREFILL),
            load=wire.load_to_pb(load_of(self.service.loop)),
            counters={**counters_of(self.service.loop, request.pool_checksum),
                      "transfers_done": float(self.service.transfers_done),
                      "snapshots_adopted": float(self.service.snapshots.adopted
                                                 if self.service.snapshots else 0),
                      "snapshots_pulled": float(self.service.snapshots.pulled
                                                if self.service.snapshots else 0),
                      "pulled_state_bytes_total": float(self.service.snapshots.state_bytes
                                                        if self.service.snapshots else 0),
                      "transfers_in_flight": float(self.service.sender.in_flight),
                      **self.service.timings.counters(),
                      **tracked_counters(self.service.loop, self.service.events,
                                         self.service.sender)},
        )
