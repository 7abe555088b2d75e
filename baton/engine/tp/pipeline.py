"""TP x PP inside one worker: PP stages, each split over TP ranks, in one gloo world.

    world rank        0 .. PP-1                     PP .. PP*TP-1
    who               stage k's leader (TP rank 0)  stage k's TP rank j (1..TP-1) at
                      = a pipeline stage as today   PP + k*(TP-1) + (j-1)

The leaders are the pipeline (`baton.engine.pipeline`) unchanged: stage 0 schedules, the
micro-batches and hidden states flow leader to leader. Each leader, before running its
layers on a micro-batch (`before_forward`), hands the plan and the input (token ids or
hidden states) to its stage's other TP ranks, and forwards every mirrored cache operation
it applies; they run the same layers on their shards, the stage's collectives (one group
per stage) keep them in lockstep, and the last stage's vocab-parallel head gathers the
logits on its leader. Canary audits and stop reach the peers through their leader.
World rank 0 (stage 0's leader, the engine) is built in `pp_model.py`.
"""

from __future__ import annotations

import baton.startup  # noqa: F401 - first: this module is a process's entry point

# isort: split

import logging
import os
import sys

import torch
import torch.distributed as dist

from baton import envs
from baton.cache.state_format import kv_dtype
from baton.engine.pipeline.channel import TAG_CTRL, TAG_REPLY, Channel
from baton.engine.pipeline.launch import (
    _die_with_parent,
    config_from_env,
    join_group,
    open_store,
    stage_layers,
)
from baton.engine.pipeline.mirror import apply_ops
from baton.engine.pipeline.stage import StageLoop, hidden_shape, last_logits, run_layers
from baton.engine.process import DTYPES, rank_threads
from baton.engine.state_rounding import live_rounding, split_snapshots
from baton.model.layers.parallel import TPGroup, collective_backend, rank_device
from baton.model.pools import Pools, PoolSpec

log = logging.getLogger("baton.tp")

TAG_PEER_IN, TAG_PEER_REPLY = 5, 6


def peer_ranks(stage: int, pp: int, tp: int) -> list[int]:
    return [pp + stage * (tp - 1) + j for j in range(tp - 1)]


def place(rank: int, pp: int, tp: int) -> tuple[int, int]:
    """(stage, TP rank) of a world rank."""
    if rank < pp:
        return rank, 0
    k, j = divmod(rank - pp, tp - 1)
    return k, j + 1


def join_stage_groups(rank: int, pp: int, tp: int, device: str = "cpu") -> TPGroup:
    """Every process creates every stage's group, in order; returns this rank's (gloo, or
    NCCL for CUDA ranks)."""
    mine = None
    backend = collective_backend(device)
    for k in range(pp):
        ranks = [k, *peer_ranks(k, pp, tp)]
        g = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = TPGroup(ranks.index(rank), tp, g, root=k, backend=backend)
    return mine


class Leader:
    """A stage leader's side of its TP peers (its model's `before_forward` hook)."""

    def __init__(self, ch: Channel, peers: list[int]):
        self.ch, self.peers = ch, peers

    def forward(self, mb: dict, h: torch.Tensor) -> None:
        for p in self.peers:
            self.ch.send_msg({**mb, "ops": []}, p, TAG_CTRL)
            self.ch.isend(h, p, TAG_PEER_IN)

    def ops(self, ops) -> None:
        for p in self.peers:
            self.ch.send_msg({"op": "ops", "ops": ops}, p, TAG_CTRL)

    def canaries(self, args: dict) -> tuple[list[int], list[int]]:
        blocks, slots = [], []
        for p in self.peers:
            self.ch.send_msg({"op": "canaries", "args": args, "ops": []}, p, TAG_CTRL)
        for p in self.peers:
            r = self.ch.recv_msg(p, TAG_PEER_REPLY)
            blocks += r["bad_blocks"]
            slots += r["bad_slots"]
        return blocks, slots

    def stop(self) -> None:
        for p in self.peers:
            self.ch.send_msg({"op": "stop", "ops": []}, p, TAG_CTRL)
        self.ch.flush()

    def call(self, name: str, args: dict, reply: bool) -> list[dict]:
        """A role's handler on every TP peer of the stage (their replies, in peer order)."""
        for p in self.peers:
            self.ch.send_msg({"op": "call", "name": name, "args": args, "reply": reply,
                              "ops": []}, p, TAG_CTRL)
        return [self.ch.recv_msg(p, TAG_PEER_REPLY) for p in self.peers] if reply else []


def attach_leader(model, pools, ch: Channel, peers: list[int], loop: StageLoop | None = None,
                  forward: frozenset[str] = frozenset()):
    """Hook a stage leader's model (and its loop's op application and canary audit); a role
    call named in `forward` (a worker's transfer agent) runs on the leader, then on each of
    its TP peers, and its reply carries theirs (`peers`, in peer order)."""
    from baton.cache.canary import bad_blocks, bad_slots

    lead = Leader(ch, peers)
    model.before_forward = lead.forward
    if loop is not None:
        def apply(ops, _apply=loop._apply):
            _apply(ops)
            lead.ops(ops)

        def canaries(a):
            b, s = lead.canaries(a)
            return {"bad_blocks": sorted(set(bad_blocks(pools, a["blocks"])) | set(b)),
                    "bad_slots": sorted(set(bad_slots(pools, a["slots"])) | set(s))}

        def call(msg, _call=loop._call):
            if msg["name"] not in forward:
                return _call(msg)
            own = call_handler(loop.handlers, msg, f"stage {ch.rank}")
            peers = lead.call(msg["name"], msg.get("args") or {}, bool(msg.get("reply")))
            if msg.get("reply"):
                ch.send_msg({**own, "peers": peers}, 0, TAG_REPLY)

        loop._apply = apply
        loop._call = call
        loop.handlers["canaries"] = canaries
    return lead


def call_handler(handlers: dict, msg: dict, who: str) -> dict:
    """A "call" message's reply: {"ok": True, **the handler's} or {"ok": False, "error"}."""
    handler = handlers.get(msg["name"])
    try:
        if handler is None:
            raise KeyError(f"{who} has no handler {msg['name']!r}")
        return {"ok": True, **(handler(msg.get("args") or {}) or {})}
    except Exception as e:  # noqa: BLE001 - reported to world rank 0, which decides
        log.exception("%s: %s failed", who, msg["name"])
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


class PeerLoop:
    """A stage's TP rank j >= 1: obey its leader until "stop"."""

    def __init__(self, model, pools, ch: Channel, leader: int, handlers=None):
        self.model, self.pools, self.ch, self.leader = model, pools, ch, leader
        self.handlers = dict(handlers or {})
        """A worker role's control handlers (this rank's transfer agent)."""

    def run(self) -> None:
        from baton.cache.canary import bad_blocks, bad_slots

        while True:
            msg = self.ch.recv_msg(self.leader, TAG_CTRL)
            apply_ops(self.pools, msg.get("ops", ()))
            op = msg["op"]
            if op == "stop":
                self.ch.flush()
                return
            if op == "fwd":
                self._forward(msg)
            elif op == "canaries":
                a = msg["args"]
                self.ch.send_msg({"bad_blocks": bad_blocks(self.pools, a["blocks"]),
                                  "bad_slots": bad_slots(self.pools, a["slots"])},
                                 self.leader, TAG_PEER_REPLY)
            elif op == "call":
                reply = call_handler(self.handlers, msg, f"TP x PP rank {self.ch.rank}")
                if msg.get("reply"):
                    self.ch.send_msg(reply, self.leader, TAG_PEER_REPLY)

    def _forward(self, mb: dict) -> None:
        n = len(mb["starts"])
        if self.model.first:
            shape = (n,) if mb["decode"] else (n, mb["T"])
            h = self.ch.recv(shape, torch.long, self.leader, TAG_PEER_IN)
        else:
            h = self.ch.recv(hidden_shape(self.model, mb), self.model.dtype, self.leader,
                             TAG_PEER_IN)
        h = run_layers(self.model, self.pools, mb, h)
        if self.model.last and mb.get("out", True):
            last_logits(self.model, h, mb["decode"])  # its part of the head's gather


def world_argv(model_path: str):
    return lambda rank, master: [sys.executable, "-m", "baton.engine.tp.pipeline",
                                 str(model_path), str(rank), master]


def setup(cfg, path, rank: int, store):
    """Join the world and the stage groups, load this rank's share of its stage:
    (stage, model, pools, group, layers)."""
    from baton.model.tp_loader import load_tp_model

    pp, tp = cfg.worker.pipeline_parallel_size, cfg.worker.tensor_parallel_size
    layers = stage_layers(cfg, path)
    stage, _ = place(rank, pp, tp)
    join_group(store, rank, pp * tp)
    group = join_stage_groups(rank, pp, tp, cfg.model.device)
    dtype = DTYPES[cfg.model.dtype]
    model = load_tp_model(path, group, rank_device(cfg.model.device, rank), dtype,
                          stage=(layers[stage], stage == 0, stage == pp - 1),
                          moe_split=cfg.worker.moe_tp_split, quantize=cfg.model.quantize)
    model.tp_place = (group.rank, tp)  # its TP rank within the stage (transfer agents)
    spec = PoolSpec.for_model(model.config, num_blocks=cfg.cache.num_blocks,
                              tokens_per_block=cfg.cache.tokens_per_block,
                              num_slots=cfg.cache.num_state_slots, layers=layers[stage],
                              dtype=dtype, device=cfg.model.device,
                              kv_dtype=kv_dtype(cfg.cache, dtype, cfg.model.device))
    # 16-bit state (docs/state-precision.md): the same snapshot split on every rank, and the
    # mirrored "round" ops applied to this rank's layers, its elements keyed by TP 1 index
    pools = Pools(split_snapshots(cfg, spec))
    pools.rounding = live_rounding(cfg.cache, pools, dtype, cfg.model.device,
                                   model.full_config.state_tensors, tp, group.rank)
    return stage, model, pools, group, layers


def serve(cfg, path, rank: int, master: str, make_handlers=None) -> int:
    """A process other than world rank 0: a stage leader or a stage's TP rank;
    `make_handlers(model, pools, channel)`: a worker role's handlers (its transfer agent)."""
    from baton.engine.tp.rank import dump_slot

    pp, tp = cfg.worker.pipeline_parallel_size, cfg.worker.tensor_parallel_size
    _die_with_parent()
    torch.set_num_threads(rank_threads(cfg, pp * tp))
    store = open_store(rank, pp * tp, master)
    stage, model, pools, _, _ = setup(cfg, path, rank, store)
    try:
        ch = Channel(stage, pp) if rank < pp else Channel(rank, pp * tp)
        handlers = make_handlers(model, pools, ch) if make_handlers is not None else {}
        handlers.setdefault("tp_dump_slot", lambda a: dump_slot(pools, a["slot"]))  # tests
        if rank < pp:
            loop = StageLoop(model, pools, ch, handlers)
            lead = attach_leader(model, pools, ch, peer_ranks(stage, pp, tp), loop,
                                 frozenset(handlers))
            loop.run()
            lead.stop()
        else:
            PeerLoop(model, pools, ch, stage, handlers).run()
    except Exception as e:  # noqa: BLE001 - the group broke or a forward failed: leave
        log.warning("TP x PP rank %d: leaving (%s)", rank, e)
        return 1
    return 0


def main(argv: list[str]) -> int:
    """`python -m baton.engine.tp.pipeline MODEL RANK MASTER` (config in the env)."""
    logging.basicConfig(level=envs.LOG_LEVEL.get())
    code = serve(config_from_env(None), argv[0], int(argv[1]), argv[2])
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
