"""gRPC face of the decode worker: protobuf stops here."""

from __future__ import annotations

import logging

from baton.errors import BatonError
from baton.proto_gen import baton_pb2, worker_pb2, worker_pb2_grpc
from baton.worker.convert import FINISH_TO_PB, abort_with
from baton.worker.load import counters_of, load_of
from decode_worker.service import DecodeService
from router.wire import sampling_from_pb

log = logging.getLogger("baton.decode")


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, service: DecodeService):
        self.service = service

    def Reserve(self, request, context):
        try:
            r = self.service.reserve(
                request.request_id, list(request.prompt_ids), sampling_from_pb(request.sampling),
                request.session_id or None,
            )
        except (BatonError, ValueError) as e:
            abort_with(context, e)
        reply = worker_pb2.ReserveReply(
            worker_id=self.service.worker_id, transfer_endpoint=r.endpoint,
            block_ids=list(r.block_ids), skip_blocks=r.skip_blocks, lease_seconds=r.lease_seconds,
        )
        if r.slot is not None:
            reply.slot = r.slot
        return reply

    def Decode(self, request, context):
        rid = request.request_id
        context.add_callback(lambda: self.service.abort(rid))
        try:
            for toks, reason in self.service.decode(rid, request.first_token_id):
                yield worker_pb2.DecodeResponse(token_ids=toks, finish_reason=FINISH_TO_PB[reason])
        except (BatonError, ValueError, RuntimeError) as e:
            log.warning("decode %s failed: %s", rid, e)
            abort_with(context, e)

    def Abort(self, request, context):
        return baton_pb2.AbortReply(found=self.service.abort(request.request_id))

    def Stats(self, request, context):
        return baton_pb2.StatsReply(
            worker_id=self.service.worker_id, role=baton_pb2.WORKER_ROLE_DECODE,
            load=load_of(self.service.loop), counters=counters_of(self.service.loop),
        )
