"""The stage channel never blocks a sender on its own queue: a stage may queue many sends
(control plans for every micro-batch, hidden states) that complete only once the peer has
got far enough, and the peer may first need a later send of this process."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

from baton.cluster.local import free_port

N, SIZE = 80, 1 << 18  # 80 sends of 1 MiB: more than the queue's pruning threshold


def _stage(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from baton.engine.pipeline.channel import Channel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ch = Channel(rank, 2)
    if rank == 0:
        for i in range(N):  # the peer reads none of these before the "go" below
            ch.isend(torch.full((SIZE,), float(i)), 1, 2)
        ch.isend(torch.ones(1), 1, 1)  # "go"
        ch.flush()
        out.put("sent")
    else:
        ch.recv((1,), torch.float32, 0, 1)
        got = [int(ch.recv((SIZE,), torch.float32, 0, 2)[0]) for _ in range(N)]
        out.put(got)
    dist.destroy_process_group()


def test_many_queued_sends_do_not_deadlock_the_sender():
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_stage, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=30) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert sorted(map(str, results)) == sorted(["sent", str(list(range(N)))])
