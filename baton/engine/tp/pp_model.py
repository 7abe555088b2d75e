"""World rank 0 of a TP x PP worker (see `baton.engine.tp.pipeline`): stage 0's leader runs
the pipeline's `PipelineModel` with its own TP ranks in tow (mirrored ops, canary audits and
stop reach them too), and starts every other rank process."""

from __future__ import annotations

import logging

import torch.distributed as dist

from baton.engine.pipeline.channel import TAG_CTRL
from baton.engine.pipeline.mirror import MirroredPools
from baton.engine.pipeline.model import PipelineModel
from baton.engine.tp.pipeline import Leader

log = logging.getLogger("baton.tp")


class LeaderPools(MirroredPools):
    """Stage 0's mirrored pools: what goes to the other stages also goes to its TP ranks."""

    lead: Leader | None = None

    def take_ops(self):
        ops = super().take_ops()
        if ops and self.lead is not None:
            self.lead.ops(ops)
        return ops


BUILT_IN = frozenset({"stats", "canaries", "expert_load"})
"""Stage-loop calls answered by the leaders alone; any other (a worker role's transfer agent)
runs on every process of the world."""


class TPPipelineModel(PipelineModel):
    def __init__(self, *a, lead: Leader, full_config, **kw):
        super().__init__(*a, **kw)
        self.lead, self.config = lead, full_config
        self.agents = self.size * (len(lead.peers) + 1)
        """Processes with a transfer agent each (`baton.worker.staged`): every world rank."""
        self.tp_place = (0, len(lead.peers) + 1)

    def call(self, name: str, args_of, reply: bool = True) -> list[dict]:
        """As the pipeline's; a role call reaches every world rank, its replies flattened in
        world order after world rank 0's: each leader, its peers, ..., stage 0's peers."""
        out = super().call(name, args_of, reply)
        if name == "canaries":  # stage 0's own TP ranks too
            with self._link():
                b, s = self.lead.canaries(args_of(1) or {})
            out.append({"ok": True, "bad_blocks": b, "bad_slots": s})
        elif name not in BUILT_IN:
            flat = []
            for r in out:
                flat += [{k: v for k, v in r.items() if k != "peers"}, *r.get("peers", [])]
            with self._link():
                flat += self.lead.call(name, args_of(0) or {}, reply)
            out = flat
        return out

    def close(self) -> None:
        """Stop to every stage and to stage 0's TP ranks, then wait for the sends: a rank
        that got its stop may exit (closing its links) while another send completes, so
        an error from the last flush is expected, not a failure."""
        if self.closed:
            return
        self.closed = True
        if self.local_stages is not None:  # the ranks exiting now is no death
            self.local_stages._stopping = True
        try:
            self._broadcast({"op": "stop"})
            for p in self.lead.peers:
                self.ch.send_msg({"op": "stop", "ops": []}, p, TAG_CTRL)
            try:
                self.ch.flush()
            except RuntimeError as e:
                log.debug("closing: %s", e)
        finally:
            if self.local_stages is not None:
                self.local_stages.stop()
            dist.destroy_process_group()
