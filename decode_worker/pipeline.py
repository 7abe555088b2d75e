"""The decode side of a pipeline-parallel worker: every stage receives its own layers.

Stage 0 (this worker's service) holds a `PipelineReceiver`, used exactly like a Receiver:
its `endpoint` lists every stage's side channel (comma-separated, in stage order, so one
signed reservation covers them all), every stage shares stage 0's incarnation, `expect`
leases the destination on every stage before the reservation is given out (the call is
also the barrier after which the mirrored cache operations have run on every stage), and
the request's event is ok only once every stage's layers landed.
"""

from __future__ import annotations

from baton.worker.staged import StagedAgent, stage_events


class PipelineReceiver(StagedAgent):
    def __init__(self, loop, local, make_event):
        super().__init__(loop, local, make_event)
        replies = self.remote("init", {"incarnation": local.incarnation}, reply=True)
        bad = [r["error"] for r in replies if not r.get("ok")]
        if bad:
            raise RuntimeError(f"a decode stage could not start its receiver: {bad[0]}")
        self.incarnation = local.incarnation
        self.endpoint = ",".join([local.endpoint, *(r["endpoint"] for r in replies)])

    @property
    def on_activity(self):
        return self.local.on_activity

    @on_activity.setter
    def on_activity(self, fn) -> None:
        self.local.on_activity = fn

    @property
    def layout(self):
        return self.local.layout

    def expect(self, request_id: str, block_ids, slot, lease_s=None) -> None:
        """On the engine loop thread (inside Reserve)."""
        self.track(request_id)
        try:
            self.local.expect(request_id, list(block_ids), slot, lease_s)
            replies = self.remote("expect", {"rid": request_id, "blocks": [int(b) for b in block_ids],
                                             "slot": slot, "lease_s": lease_s}, reply=True)
            bad = [r["error"] for r in replies if not r.get("ok")]
            if bad:
                raise RuntimeError(f"a decode stage refused {request_id}: {bad[0]}")
        except BaseException:
            self.forget(request_id)
            self.abort_stages(request_id, "reservation failed")
            # Reserve fails: the engine's hold on the blocks and slot (taken just before, on
            # this same loop thread) must not outlive it
            self.loop.engine.abort(request_id)
            raise

    def abort(self, request_id: str, reason: str = "aborted by the decode worker") -> None:
        self.abort_stages(request_id, reason)  # the failure event comes from a poll

    def close(self) -> None:
        self.local.close()


def stage_handlers(cfg, secret, host: str):
    """The handlers of a decode stage other than 0: its own Receiver on its own pools."""

    def make(model, pools, channel):
        from transfer import SIDE_CHANNEL, compute_fingerprint, make_receiver

        key = None if secret is None else secret.key(SIDE_CHANNEL)
        receiver = make_receiver(cfg.transfer, pools,
                                 compute_fingerprint(model.config, pools.spec), bind_host=host,
                                 key=key)

        def init(a):
            receiver.incarnation = a["incarnation"]  # before any handshake: one for all stages
            return {"endpoint": receiver.endpoint}

        def expect(a):
            receiver.expect(a["rid"], a["blocks"] if pools.has_kv else [],
                            a["slot"] if pools.has_state else None, a["lease_s"])

        return {
            "init": init,
            "expect": expect,
            "abort": lambda a: receiver.abort(a["rid"], a["reason"]),
            "poll": lambda a: stage_events(receiver),
        }

    return make
