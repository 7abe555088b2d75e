"""A worker's load as the router sees it."""

from __future__ import annotations

import zlib

import torch

from baton.contract import WorkerLoad
from baton.engine.loop import EngineLoop


def load_of(loop: EngineLoop) -> WorkerLoad:
    """Read without pausing the loop: heartbeats must not wait behind a long step (a busy
    worker that heartbeats late gets ejected). The numbers may be one step stale."""
    eng = loop.engine
    spec = eng.pools.spec
    return WorkerLoad(
        running=len(eng.scheduler.running), waiting=len(eng.scheduler.waiting),
        free_blocks=eng.cache.num_available_blocks, free_slots=eng.cache.num_free_slots,
        total_blocks=spec.num_blocks, total_slots=spec.num_slots,
    )


def counters_of(loop: EngineLoop, pool_checksum: bool = False) -> dict[str, float]:
    """Cache stats plus `integrity_ok`, `live_requests` and `prefilled_tokens` (prompt tokens
    this worker computed), for Stats RPCs and tests;
    `pool_crc32` too when asked (a CRC-32 over every pool byte)."""

    def read():
        cache = loop.engine.cache
        try:
            cache.check_integrity()
            ok = 1.0
        except AssertionError:
            ok = 0.0
        out = {k: float(v) for k, v in vars(cache.stats()).items()}
        out.update(integrity_ok=ok, live_requests=float(len(cache.live_requests())),
                   engine_requests=float(len(loop.engine.requests)),
                   prefilled_tokens=float(loop.engine.prefilled_tokens))
        if pool_checksum:
            out["pool_crc32"] = float(_pools_crc32(loop.engine.pools))
        return out

    return loop.call(read)


def _pools_crc32(pools) -> int:
    crc = 0
    for t in (pools.kv, pools.conv, pools.ssm):
        crc = zlib.crc32(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy(), crc)
    return crc
