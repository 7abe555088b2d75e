"""World rank 0 of a TP x PP worker (see `baton.engine.tp.pipeline`): stage 0's leader runs
the pipeline's `PipelineModel` with its own TP ranks in tow (mirrored ops, canary audits and
stop reach them too), and starts every other rank process."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from baton.engine.pipeline.channel import TAG_CTRL, Channel
from baton.engine.pipeline.launch import LocalStages, open_store
from baton.engine.pipeline.mirror import MirroredPools
from baton.engine.pipeline.model import PipelineModel
from baton.engine.tp.launch import rank_layout, rank_threads, warn_cores
from baton.engine.tp.pipeline import Leader, attach_leader, peer_ranks, setup, world_argv
from baton.model import family
from baton.model.config import load_config
from baton.model.pools import PoolSpec

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


def build_tp_pipeline_engine(cfg, path, on_rank_death=None, on_link_lost=None, argv=None):
    """World rank 0 (stage 0's leader) of a TP x PP worker; `argv(rank, master)`: the other
    ranks' command line (default bare ranks; a worker's run its role's transfer agent)."""
    from baton.cache.manager import HybridCacheManager
    from baton.engine.builder import _maybe_arm_canaries
    from baton.engine.engine import Engine
    from baton.model.tokenizer import load_tokenizer

    pp, tp = cfg.worker.pipeline_parallel_size, cfg.worker.tensor_parallel_size
    world = pp * tp
    threads = rank_threads(world)
    torch.set_num_threads(threads)
    mcfg = load_config(path)
    family.of(mcfg).tp_module().local_config(mcfg, tp, cfg.worker.moe_tp_split)  # refused here, before
    # any rank starts
    warn_cores(world, f"TP {tp} x PP {pp} = {world}")
    store = open_store(0, world, None)
    ranks = LocalStages(cfg, argv or world_argv(str(path)), f"127.0.0.1:{store.port}", world,
                        on_rank_death)
    try:
        _, shard, local, group, layers = setup(cfg, path, 0, store)
    except BaseException:
        ranks.kill()
        raise
    full = PoolSpec.for_model(shard.config, num_blocks=cfg.cache.num_blocks,
                              tokens_per_block=cfg.cache.tokens_per_block,
                              num_slots=cfg.cache.num_state_slots, dtype=local.spec.dtype,
                              device=cfg.model.device)
    pools = LeaderPools(full, local)
    ch = Channel(0, pp)
    pools.lead = attach_leader(shard, local, ch, peer_ranks(0, pp, tp))
    cache = HybridCacheManager(cfg.cache, pools, max_live=cfg.worker.max_num_seqs)
    _maybe_arm_canaries(cache)
    model = TPPipelineModel(shard, pools, ch, layers, local_stages=ranks,
                            on_link_lost=on_link_lost, lead=pools.lead,
                            full_config=shard.full_config)
    pids = ranks.pids()
    stages = "\n".join(
        f"  stage {k} layers [{r.start}, {r.stop}): world ranks "
        f"{[k, *peer_ranks(k, pp, tp)]} (TP ranks 0..{tp - 1}), pids "
        f"{[pids.get(x, os.getpid()) for x in [k, *peer_ranks(k, pp, tp)]]}"
        for k, r in enumerate(layers))
    model.rank_layout = (f"tensor-parallel engine ready: TP {tp} x PP {pp} = {world} rank "
                         f"processes, {threads} torch thread(s) each; stage 0 TP rank 0 "
                         f"schedules\n{stages}\n{rank_layout(shard.full_config, tp, {})}")
    log.info("%s", model.rank_layout)
    return Engine(model, cache, cfg.worker, tokenizer=load_tokenizer(path))
