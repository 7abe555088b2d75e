"""Ranks 1..N-1 of a tensor-parallel worker: the pipeline's stage loop, whose forward is the
rank's shard of the whole model (token ids in the plan, no hidden states on the wire; the
logits go to rank 0 through the head's gather)."""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from baton.engine.pipeline.mirror import apply_ops
from baton.engine.pipeline.stage import StageLoop

log = logging.getLogger("baton.tp")


class TPRankLoop(StageLoop):
    def __init__(self, model, pools, channel, tp, handlers=None):
        super().__init__(model, pools, channel, handlers)
        self.tp = tp
        self.digest = hashlib.sha256()
        self.handlers["ops_digest"] = lambda a: {"digest": self.digest.hexdigest()}
        self.handlers["tp_stats"] = lambda a: {**tp.stats(), "busy_s": self.busy_s}

    def _apply(self, ops) -> None:
        # every op rank 0 sent (ahead of each message) feeds the digest, then is applied
        self.digest.update(repr([list(o) for o in ops]).encode())
        apply_ops(self.pools, ops)

    @torch.inference_mode()
    def _forward(self, mb: dict) -> None:
        t0 = time.perf_counter()
        ids = torch.tensor(mb["ids"], dtype=torch.long)
        if mb["decode"]:
            self.model.decode(ids, torch.tensor(mb["starts"], dtype=torch.long), mb["tables"],
                              torch.tensor(mb["slots"], dtype=torch.long), self.pools)
        else:
            self.model.prefill_batch(ids, mb["starts"], mb["tables"], mb["slots"], self.pools,
                                     mb.get("all_logits", False))
        self.busy_s += time.perf_counter() - t0
