"""The decode side of a pipeline-parallel worker: every stage receives its own layers.

Stage 0 (this worker's service) holds a `PipelineReceiver`, used exactly like a Receiver:
its `endpoint` lists every stage's side channel (comma-separated, in stage order, so one
signed reservation covers them all), every stage shares stage 0's incarnation, `expect`
leases the destination on every stage before the reservation is given out (the call is
also the barrier after which the mirrored cache operations have run on every stage), and
the request's event is ok only once every stage's layers landed.
"""

from __future__ import annotations

import threading
import time
import uuid

from baton.worker.staged import StagedAgent, stage_events
from transfer.receiver import Quarantined

RECHECK_S = 0.2
"""How often the stages are asked whether they still hold a quarantine."""


class PipelineReceiver(StagedAgent):
    def __init__(self, loop, local, make_event):
        super().__init__(loop, local, make_event)
        replies = self.remote("init", {"incarnation": local.incarnation}, reply=True)
        bad = [r["error"] for r in replies if not r.get("ok")]
        if bad:
            raise RuntimeError(f"a decode stage could not start its receiver: {bad[0]}")
        self.incarnation = local.incarnation
        self.endpoint = ",".join([local.endpoint, *(r["endpoint"] for r in replies)])
        self._qlock = threading.Lock()
        self._quarantines: dict[str, tuple[Quarantined, dict[int, str]]] = {}
        """rid -> (the worker's quarantine over every stage, stage -> that stage's key still
        held): released to the worker once no stage holds anything of it."""
        self._release_cb = None
        self._recheck_at = 0.0
        local.on_release = lambda key: self._stage_released(0, key)

    # ---- quarantine over every stage (transfer/receiver.py's, per stage) ----------------
    @property
    def on_release(self):
        return self._release_cb

    @on_release.setter
    def on_release(self, fn) -> None:
        self._release_cb = fn

    def held(self, request_id: str) -> Quarantined | None:
        """The failed reservation's quarantine if ANY stage may still be written (a late
        write into stage k's pools lands in the same block ids): one for the worker's cache
        manager, over the union, released when every stage released its own. Asked on the
        engine loop thread, one asker at a time: the abort of a reservation (on the loop) and
        its transfer's failure (the events thread) may ask at once, and both must get the one
        quarantine that the cache holds and that the release names. (A lock of its own here
        deadlocked: an asker holding it waits for the loop, to reach the other stages, while
        the loop waits for the lock.)"""
        return self.loop.call(self._held, request_id)

    def _held(self, request_id: str) -> Quarantined | None:
        with self._qlock:
            known = self._quarantines.get(request_id)
        if known is not None:
            return known[0]
        keys: dict[int, str] = {}
        blocks: set[int] = set()
        slot = None
        q0 = self.local.held(request_id)
        if q0 is not None:
            keys[0], slot = q0.key, q0.slot
            blocks |= q0.blocks
        for k, r in enumerate(self.remote("held", {"rid": request_id}, reply=True), start=1):
            if r.get("key"):
                keys[k] = r["key"]
                blocks |= set(r["blocks"])
                slot = slot if slot is not None else r.get("slot")
        if not keys:
            return None
        q = Quarantined(f"{request_id}#pp-{uuid.uuid4().hex[:8]}", request_id,
                        frozenset(blocks), slot, time.monotonic(), set(), {})
        with self._qlock:
            self._quarantines[request_id] = (q, keys)
        return q

    def serve_reads(self, request_id: str, held: bool) -> None:
        """Pulls between pipeline-parallel workers are refused by the puller: only this
        stage's transport can be a READ source."""
        self.local.serve_reads(request_id, held)

    def remote_pending(self) -> bool:
        with self._qlock:
            held = bool(self._quarantines)
        return super().remote_pending() or held

    def poll_interval(self) -> float | None:
        if self._oks:
            return super().poll_interval()
        with self._qlock:
            held = bool(self._quarantines)
        local = self.local.poll_interval()
        if not held:
            return local
        return RECHECK_S if local is None else min(local, RECHECK_S)

    def poll(self) -> list:
        out = super().poll()
        now = time.monotonic()
        if now >= self._recheck_at:
            self._recheck_at = now + RECHECK_S
            self._recheck()
        return out

    def _recheck(self) -> None:
        """A stage whose quarantine is gone (released, its notice missed: it can come before
        the worker asked) no longer holds the request."""
        with self._qlock:
            pending = {rid: dict(keys) for rid, (_, keys) in self._quarantines.items()}
        for rid, keys in pending.items():
            if 0 in keys:
                q0 = self.local.held(rid)
                if q0 is None or q0.key != keys[0]:
                    self._stage_released(0, keys[0])
            if any(k != 0 for k in keys):
                replies = self.remote("held", {"rid": rid}, reply=True)
                for k, key in keys.items():
                    if k != 0 and replies[k - 1].get("key") != key:
                        self._stage_released(k, key)

    def stage_reply(self, stage: int, reply: dict) -> None:
        for key in reply.get("released", ()):
            self._stage_released(stage, key)

    def _stage_released(self, stage: int, key: str) -> None:
        done = None
        with self._qlock:
            for rid, (q, keys) in list(self._quarantines.items()):
                if keys.get(stage) == key:
                    del keys[stage]
                    if not keys:
                        del self._quarantines[rid]
                        done = q.key
                    break
        if done is not None and self._release_cb is not None:
            self._release_cb(done)

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
        from baton.worker.staged import rank_of, whole_config
        from transfer import SIDE_CHANNEL, make_receiver, tp_identity

        key = None if secret is None else secret.key(SIDE_CHANNEL)
        fp, _ = tp_identity(whole_config(model), pools.spec, *rank_of(model, channel))
        receiver = make_receiver(cfg.transfer, pools, fp, bind_host=host, key=key)

        def init(a):
            receiver.incarnation = a["incarnation"]  # before any handshake: one for all stages
            return {"endpoint": receiver.endpoint}

        released: list[str] = []
        receiver.on_release = released.append

        def held(a):
            q = receiver.held(a["rid"])
            return {} if q is None else {"key": q.key, "blocks": sorted(q.blocks),
                                         "slot": q.slot}

        def poll(a):
            reply = stage_events(receiver)  # runs the receiver's poll: fills `released`
            reply["released"], released[:] = list(released), []
            return reply

        def expect(a):
            receiver.expect(a["rid"], a["blocks"] if pools.has_kv else [],
                            a["slot"] if pools.has_state else None, a["lease_s"])

        return {
            "init": init,
            "expect": expect,
            "abort": lambda a: receiver.abort(a["rid"], a["reason"]),
            "held": held,
            "poll": poll,
        }

    return make
