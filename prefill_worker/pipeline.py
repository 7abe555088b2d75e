"""The prefill side of a pipeline-parallel worker: every stage sends its own layers.

Stage 0 (this worker's service) holds a `PipelineSender`, used exactly like a Sender: a
`send` posts stage 0's layers and tells every other stage (control call, in order after its
last forward of the request) to post its layers to every decode stage. The decode side's
stages are the comma-separated endpoints of the reservation's `transfer_endpoint`.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton.worker.staged import StagedAgent, stage_events


def endpoints_of(endpoint: str | Sequence[str]) -> list[str]:
    """One endpoint or a list of them (`Reservation.endpoints`)."""
    return [endpoint] if isinstance(endpoint, str) else list(endpoint)


class PipelineSender(StagedAgent):
    streams_layers = False
    """Its `send` posts every stage at once: the prefill service must not begin it mid-forward
    (layer-wise handoff and the whole post at the forward's end are off)."""

    @property
    def layout(self):
        return self.local.layout

    @property
    def in_flight(self) -> int:
        """Requests being sent by any stage."""
        return max(self.local.in_flight, len(self._oks))

    def connect(self, endpoint: str):
        """Stage 0's handshake (the other stages shake hands on their first send)."""
        return self.local.connect(endpoint)

    def peer_layout(self, endpoint: str):
        return self.local.peer_layout(endpoint)

    def claim(self, request_id, endpoint, dst_block_ids, dst_slot, skip_blocks=0,
              incarnation=None) -> None:
        """Stage 0's claim, ahead of the send (the other stages claim in their `send`, and
        wait there for the grant: their control call runs after their last forward)."""
        self.local.claim(request_id, endpoints_of(endpoint), dst_block_ids, dst_slot,
                         skip_blocks, incarnation)

    def send(self, request_id, endpoint, src_block_ids, src_slot, dst_block_ids, dst_slot,
             skip_blocks=0, incarnation=None, layerwise=False, handshake=True) -> None:
        eps = endpoints_of(endpoint)
        args = {"rid": request_id, "endpoints": eps, "src_blocks": [int(b) for b in src_block_ids],
                "src_slot": src_slot, "dst_blocks": [int(b) for b in dst_block_ids],
                "dst_slot": dst_slot, "skip": int(skip_blocks), "incarnation": incarnation}
        self.track(request_id)
        self.local.send(request_id, eps, src_block_ids, src_slot, dst_block_ids, dst_slot,
                        skip_blocks=skip_blocks, incarnation=incarnation, handshake=handshake)
        self.remote("send", args)

    def layers_done(self, request_id, layers) -> None:
        pass  # layer-wise handoff is off with pipeline parallelism

    def abort(self, request_id: str, reason: str = "aborted by the prefill worker") -> None:
        self.forget(request_id)
        self.abort_stages(request_id, reason)

    def close(self) -> None:
        self.local.close()


def stage_handlers(cfg, secret):
    """The handlers of a prefill stage other than 0: its own Sender on its own pools."""

    def make(model, pools, channel):
        from baton.worker.staged import rank_of, whole_config
        from transfer import SIDE_CHANNEL, make_sender, tp_identity

        key = None if secret is None else secret.key(SIDE_CHANNEL)
        fp, tp = tp_identity(whole_config(model), pools.spec, *rank_of(model, channel))
        sender = make_sender(cfg.transfer, pools, fp, key, tp)

        def send(a):
            sender.send(a["rid"], a["endpoints"], a["src_blocks"], a["src_slot"],
                        a["dst_blocks"], a["dst_slot"], skip_blocks=a["skip"],
                        incarnation=a["incarnation"])

        return {
            "send": send,
            "abort": lambda a: sender.abort(a["rid"], a["reason"]),
            "poll": lambda a: stage_events(sender),
        }

    return make
