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


def dump_request(pools, blocks: list[int], slot: int) -> dict:
    """This rank's bytes of one request: its KV blocks (every layer, in table order) and its
    slot of every state tensor (a test / tool path: the cluster moves bytes by transfer)."""
    idx = torch.tensor(blocks, dtype=torch.long)
    kv = pools.kv.view(torch.uint8)  # as bytes: numpy holds no bfloat16 or fp8
    out = {"kv": kv.index_select(1, idx).contiguous().numpy().tobytes()}
    out["state"] = {n: t[:, slot].contiguous().numpy().tobytes() for n, t in pools.state.items()}
    return out


def load_request(pools, data: dict, blocks: list[int], slot: int, skip: int = 0) -> None:
    """Write `dump_request`'s bytes (of a rank with this rank's shard) into blocks / slot;
    the first `skip` blocks are left alone (a cached prefix the destination shares)."""
    idx = torch.tensor(blocks[skip:], dtype=torch.long)
    pool = pools.kv.view(torch.uint8)  # as bytes: torch copies no fp8 by index
    shape = (pool.shape[0], len(blocks), *pool.shape[2:])
    kv = torch.frombuffer(bytearray(data["kv"]), dtype=torch.uint8).view(shape)
    pool.index_copy_(1, idx, kv[:, skip:])
    for n, t in pools.state.items():
        src = torch.frombuffer(bytearray(data["state"][n]), dtype=t.dtype)
        t[:, slot].copy_(src.view(t[:, slot].shape))


def dump_slot(pools, slot: int) -> dict:
    """This rank's bytes of state slot `slot` (live or snapshot, in its stored dtype), per
    state tensor (a test / tool path)."""
    return {"state": {n: pools.slot(n, slot).contiguous().view(torch.uint8).numpy().tobytes()
                      for n in pools.state}}


class TPRankLoop(StageLoop):
    def __init__(self, model, pools, channel, tp, handlers=None):
        super().__init__(model, pools, channel, handlers)
        self.tp = tp
        self.digest = hashlib.sha256()
        self.handlers["ops_digest"] = lambda a: {"digest": self.digest.hexdigest()}
        self.handlers["tp_stats"] = lambda a: {**tp.stats(), "busy_s": self.busy_s}
        self.handlers["tp_dump"] = lambda a: dump_request(pools, a["blocks"], a["slot"])
        self.handlers["tp_dump_slot"] = lambda a: dump_slot(pools, a["slot"])
        self.handlers["tp_load"] = lambda a: load_request(pools, a, a["blocks"], a["slot"],
                                                          a.get("skip", 0))

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
