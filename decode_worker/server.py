"""gRPC face of the decode worker: protobuf stops here."""

from __future__ import annotations

import logging

from baton.contract import Role, wire
from baton.contract.status import abort_with
from baton.errors import BatonError, LocalPrefillDeclined
from baton.proto_gen import baton_pb2, worker_pb2_grpc
from baton.worker.load import counters_of, load_of, tracked_counters
from decode_worker.service import DecodeService

log = logging.getLogger("baton.decode")


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, service: DecodeService):
        self.service = service

    def Reserve(self, request, context):
        try:
            return wire.reservation_to_pb(self.service.reserve(wire.reserve_from_pb(request)))
        except (BatonError, ValueError) as e:
            abort_with(context, e)

    def Decode(self, request, context):
        rid = request.request_id
        context.add_callback(lambda: self.service.abort(rid))
        try:
            firsts = [request.first_token_id, *request.more_first_token_ids]
            for chunk in self.service.decode(rid, firsts if len(firsts) > 1 else firsts[0]):
                yield wire.decode_chunk_to_pb(chunk)
        except (BatonError, ValueError, RuntimeError) as e:
            log.warning("decode %.80r failed: %s", rid, e)
            abort_with(context, e)

    def Serve(self, request, context):
        rid = request.request_id
        context.add_callback(lambda: self.service.abort(rid))
        try:
            for chunk in self.service.serve(wire.serve_from_pb(request)):
                yield wire.decode_chunk_to_pb(chunk)
        except (BatonError, ValueError, RuntimeError) as e:
            log.log(logging.INFO if isinstance(e, LocalPrefillDeclined) else logging.WARNING,
                    "serve %s: %s", rid, e)
            abort_with(context, e)

    def HoldSnapshot(self, request, context):
        try:
            res = self.service.shipper.hold(wire.reserve_from_pb(request))
            return wire.reservation_to_pb(res)
        except (BatonError, ValueError) as e:
            log.info("hold snapshot %s: %s", request.request_id, e)
            abort_with(context, e)

    def Abort(self, request, context):
        rid = request.request_id
        if request.HasField("sample"):
            return baton_pb2.AbortReply(found=self.service.abort_sample(rid, request.sample))
        held = self.service.shipper is not None and self.service.shipper.release(rid)
        return baton_pb2.AbortReply(found=self.service.abort(rid) or held)

    def Stats(self, request, context):
        return baton_pb2.StatsReply(
            worker_id=self.service.worker_id, role=wire.role_to_pb(Role.DECODE),
            load=wire.load_to_pb(load_of(self.service.loop)),
            counters={**counters_of(self.service.loop, request.pool_checksum),
                      "local_requests": float(self.service.local.requests),
                      "local_declined": float(self.service.local.declined),
                      "snapshots_held_for_pull": float(self.service.shipper.holds
                                                       if self.service.shipper else 0),
                      **tracked_counters(self.service.loop, self.service, self.service.events,
                                         self.service.receiver, self.service.shipper)},
        )
