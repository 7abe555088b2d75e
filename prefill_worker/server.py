"""gRPC face of the prefill worker: protobuf stops here."""

from __future__ import annotations

import logging

from baton.errors import BatonError
from baton.proto_gen import baton_pb2, worker_pb2, worker_pb2_grpc
from baton.worker.convert import FINISH_TO_PB, abort_with
from baton.worker.load import counters_of, load_of
from prefill_worker.service import Destination, PrefillService
from router.wire import sampling_from_pb

log = logging.getLogger("baton.prefill")


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, service: PrefillService):
        self.service = service

    def Prefill(self, request, context):
        d = request.destination
        dest = Destination(
            worker_id=d.worker_id, endpoint=d.transfer_endpoint, block_ids=tuple(d.block_ids),
            slot=d.slot if d.HasField("slot") else None, skip_blocks=d.skip_blocks,
            lease_seconds=d.lease_seconds or 30.0,
        )
        # runs when the RPC ends: a no-op after success, frees the request if the router cancelled
        context.add_callback(lambda: self.service.abort(request.request_id))
        try:
            res = self.service.prefill(
                request.request_id, list(request.prompt_ids), sampling_from_pb(request.sampling),
                request.session_id or None, dest,
            )
        except (BatonError, ValueError) as e:
            log.warning("prefill %s failed: %s", request.request_id, e)
            abort_with(context, e)
        return worker_pb2.PrefillReply(
            first_token_id=res.first_token, cached_tokens=res.cached_tokens,
            finished=res.finish_reason is not None, finish_reason=FINISH_TO_PB[res.finish_reason],
        )

    def Abort(self, request, context):
        return baton_pb2.AbortReply(found=self.service.abort(request.request_id))

    def Stats(self, request, context):
        return baton_pb2.StatsReply(
            worker_id=self.service.worker_id, role=baton_pb2.WORKER_ROLE_PREFILL,
            load=load_of(self.service.loop),
            counters={**counters_of(self.service.loop),
                      "transfers_done": float(self.service.transfers_done)},
        )
