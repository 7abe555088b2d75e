"""Rank 0's stand-in for a family's model under tensor parallelism: `prefill_batch` / `decode`
send the forward's plan to ranks 1..N-1, then run rank 0's shard of it; the collectives in
the layers keep the ranks in lockstep. Sync, role calls (canaries, stats) and close are the
pipeline's (`PipelineModel`): the ranks obey the same control messages as PP stages."""

from __future__ import annotations

import hashlib

import torch

from baton.engine.pipeline.mirror import MirroredPools
from baton.engine.pipeline.model import PipelineModel
from baton.errors import InvalidRequestError


class DigestPools(MirroredPools):
    """Mirrored pools that also keep a running digest of every operation sent to the ranks,
    which each rank keeps of what it applied (`ops_digest`: compared by the integrity check)."""

    def __init__(self, spec, local):
        super().__init__(spec, local)
        self.digest = hashlib.sha256()

    def take_ops(self):
        ops = super().take_ops()
        self.digest.update(repr([list(o) for o in ops]).encode())
        return ops


class TPModel(PipelineModel):
    def __init__(self, shard, full_config, pools: DigestPools, channel, tp, local_ranks=None,
                 on_link_lost=None):
        super().__init__(shard, pools, channel, [range(full_config.num_layers)],
                         local_stages=local_ranks, on_link_lost=on_link_lost)
        self.config = full_config
        """The whole model's (the engine's vocabulary, special tokens, layers)."""
        self.shard = shard
        self.tp = tp
        self.tp_place = (tp.rank, tp.size)

    def close(self) -> None:
        if not self.closed and self.local_stages is not None:
            self.local_stages._stopping = True  # the ranks exiting now is no death
        super().close()

    def make_pools(self, *a, **kw):
        return self.shard.make_pools(*a, **kw)

    def prefill_batch(self, input_ids, start_positions, block_tables, slots, pools=None,
                      all_logits: bool = False, on_layer=None) -> torch.Tensor:
        if input_ids.shape[1] == 0:  # refused before the ranks start a forward
            raise InvalidRequestError("prefill got no tokens: input_ids is empty")
        msg = {"op": "fwd", "decode": False, "ids": input_ids.tolist(),
               "starts": list(start_positions), "tables": [list(b) for b in block_tables],
               "slots": list(slots), "all_logits": bool(all_logits)}
        return self._lockstep(msg, lambda: self.shard.prefill_batch(
            input_ids, list(start_positions), block_tables, list(slots), self.pools.local,
            all_logits, on_layer))

    def decode(self, input_ids, positions, block_tables, slots, pools=None) -> torch.Tensor:
        msg = {"op": "fwd", "decode": True, "ids": input_ids.tolist(),
               "starts": positions.tolist(), "tables": [list(b) for b in block_tables],
               "slots": slots.tolist()}
        return self._lockstep(msg, lambda: self.shard.decode(
            input_ids, positions, block_tables, slots, self.pools.local))

    def _lockstep(self, msg: dict, forward) -> torch.Tensor:
        """A forward on every rank. A failure once the ranks have started breaks the group's
        collective order for good: the worker leaves (`on_link_lost`), as a broken PP link."""
        with self._link():
            self._broadcast(msg)
            out = forward()
            self.ch.flush()
        return out

    def ops_digests(self) -> list[str]:
        """Every rank's digest of the cache operations it applied (rank 0's first)."""
        replies = self.call("ops_digest", lambda k: {})
        return [self.pools.digest.hexdigest(), *(r["digest"] for r in replies)]

    def dump(self, blocks: list[int], slot: int) -> list[dict]:
        """Every rank's bytes of one request's blocks and slot (rank 0's first)."""
        from baton.engine.tp.rank import dump_request

        args = {"blocks": list(blocks), "slot": slot}
        return [dump_request(self.pools.local, blocks, slot),
                *self.call("tp_dump", lambda k: args)]

    def load(self, per_rank: list[dict], blocks: list[int], slot: int, skip: int = 0) -> None:
        """Write each rank's bytes (`dump` of a rank with the same shard) into blocks / slot
        on every rank, before the next forward (the first `skip` blocks left alone)."""
        from baton.engine.tp.rank import load_request

        load_request(self.pools.local, per_rank[0], blocks, slot, skip)
        for r in self.call("tp_load", lambda k: {**per_rank[k], "blocks": list(blocks),
                                                 "slot": slot, "skip": skip}):
            if not r.get("ok"):
                raise RuntimeError(f"a rank's load failed: {r.get('error')}")

    def rank_stats(self) -> list[dict]:
        """Collectives and forward seconds of every rank (rank 0's first)."""
        replies = self.call("tp_stats", lambda k: {})
        return [{**self.tp.stats(), "busy_s": self.busy_s}, *replies]
