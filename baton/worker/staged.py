"""A transfer agent spread over the stages of a pipeline-parallel worker, seen from stage 0.

Every stage process runs its own agent (a Sender or a Receiver on its own pools); stage 0's
facade (`prefill_worker/pipeline.py`, `decode_worker/pipeline.py`) drives the others with
control calls on the engine loop thread (the only thread that talks to the stages) and
joins their per-stage events: a request's event is ok once every stage reported ok, and
fails as soon as one stage fails (the facade then aborts it on the others).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from baton.engine.loop import EngineLoop

log = logging.getLogger("baton.worker")

REMOTE_POLL_S = 0.002
"""Poll interval while another stage may still report (one control round trip each)."""


class StagedAgent:
    def __init__(self, loop: EngineLoop, local, make_event: Callable[[str, bool, str | None],
                                                                     object]):
        self.loop = loop
        self.local = local
        """Stage 0's own agent."""
        self.model = loop.engine.model
        """The PipelineModel: `call(name, args_of, reply)` reaches stages 1..N-1."""
        self.size = self.model.agents
        """Processes with an agent: PP stages, TP ranks, or every rank of TP x PP."""
        self._make_event = make_event
        self._oks: dict[str, set[int]] = {}
        """Requests in flight on the stages -> stages that reported ok."""

    def remote(self, name: str, args: dict, reply: bool = False) -> list[dict]:
        """Run handler `name` on every other stage (on the engine loop thread)."""
        return self.loop.call(self.model.call, name, lambda k: args, reply)

    def track(self, request_id: str) -> None:
        self._oks[request_id] = set()

    def forget(self, request_id: str) -> None:
        self._oks.pop(request_id, None)

    def tracked(self) -> dict[str, int]:
        """Stage 0's agent's bookkeeping, plus requests in flight on the stages."""
        return {**self.local.tracked(), "stage_requests": len(self._oks)}

    def remote_pending(self) -> bool:
        """Whether the other stages may still report something (polled while True)."""
        return bool(self._oks)

    def stage_reply(self, stage: int, reply: dict) -> None:
        """Anything else a stage's poll reply carries (subclasses)."""

    def poll_interval(self) -> float | None:
        local = self.local.poll_interval()
        if self.remote_pending():
            return REMOTE_POLL_S if local is None else min(local, REMOTE_POLL_S)
        return local

    def poll(self) -> list:
        per_stage = [(0, ev.request_id, ev.ok, ev.error) for ev in self.local.poll()]
        if self.remote_pending():
            for k, reply in enumerate(self.remote("poll", {}, reply=True), start=1):
                per_stage += [(k, rid, ok, err) for rid, ok, err in reply.get("events", [])]
                self.stage_reply(k, reply)
        out = []
        for stage, rid, ok, err in per_stage:
            oks = self._oks.get(rid)
            if oks is None:
                continue  # already decided (or never tracked)
            if not ok:
                self.forget(rid)
                self.abort_stages(rid, f"stage {stage}: {err}")
                out.append(self._make_event(rid, False, f"pipeline stage {stage}: {err}"))
                continue
            oks.add(stage)
            if len(oks) == self.size:
                self.forget(rid)
                out.append(self._make_event(rid, True, None))
        return out

    def abort_stages(self, request_id: str, reason: str) -> None:
        """Abort on every stage (events of stages that already finished are dropped)."""
        self.local.abort(request_id, reason)
        try:
            self.remote("abort", {"rid": request_id, "reason": reason})
        except RuntimeError as e:  # the engine loop is stopped: the stages go with it
            log.debug("abort of %s on the other stages skipped: %s", request_id, e)


def rank_of(model, channel=None) -> tuple[int, int]:
    """(TP rank, TP size) of the process holding `model` (`protocol.CausalLM`): its declared
    `tp_place` (rank 0's TPModel, a TP x PP rank), a rank's shard's channel (it has a
    `full_config`), else (0, 1)."""
    if model.tp_place is not None:
        return model.tp_place
    if channel is not None and model.full_config is not None:
        return channel.rank, channel.size
    return 0, 1


def whole_config(model):
    """The whole model's config (a TP rank's shard holds its local one in `.config`)."""
    return model.full_config or model.config


def stage_events(agent) -> dict:
    """A stage's reply to "poll": its agent's events as [rid, ok, error] lists."""
    return {"events": [[ev.request_id, ev.ok, ev.error] for ev in agent.poll()]}
