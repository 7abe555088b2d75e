"""A worker's load as the router sees it."""

from __future__ import annotations

import logging
import zlib

import torch

from baton.cache.canary import bad_blocks, bad_slots
from baton.contract import WorkerLoad
from baton.engine.loop import EngineLoop
from baton.model.layers.moe import routed_tokens

log = logging.getLogger("baton.worker")


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
        digests = loop.engine.model.ops_digests() if staged(loop.engine) else []
        if len(set(digests)) > 1:
            # a tensor-parallel rank applied other cache operations than rank 0 decided
            log.error("tensor-parallel ranks' cache operation digests differ: %s", digests)
            ok = 0.0
        stats = dict(vars(cache.stats()))
        tiers = stats.pop("tiers", {})
        out = {k: float(v) for k, v in stats.items()}
        for name, counters in tiers.items():  # tier_disk_hits, tier_shared_errors, ...
            out.update({f"tier_{name}_{k}": float(v) for k, v in counters.items()})
        out.update(integrity_ok=ok, live_requests=float(len(cache.live_requests())),
                   engine_requests=float(len(loop.engine.requests)),
                   prefilled_tokens=float(loop.engine.prefilled_tokens))
        w = loop.engine.weights
        if w is not None:  # the format as a key (counters are numbers): weight_format.<format>
            out.update({"weight_bytes": float(w.bytes), f"weight_format.{w.format}": 1.0})
        spec = loop.engine.pools.spec
        if spec.attn_layers:  # issue 50: the stored KV format and its real bytes a block
            out.update({"kv_block_bytes": float(spec.kv_bytes_per_block()),
                        f"kv_format.{str(spec.kv_store_dtype).removeprefix('torch.')}": 1.0})
        if pool_checksum:
            out["pool_crc32"] = float(_pools_crc32(loop.engine.pools))
        if cache.canaries:
            out.update(canary_audit(loop.engine))
        for layer, counts in expert_load(loop.engine).items():
            out.update({f"expert_tokens_l{layer}_e{e}": float(c) for e, c in enumerate(counts)})
        return out

    return loop.call(read)


def staged(engine) -> bool:
    """Whether the engine's model runs across processes (`Capabilities.staged`: it answers
    `protocol.StagedLM`); a stand-in engine without a model does not."""
    return engine.model is not None and engine.model.capabilities.staged


def has_moe(engine) -> bool:
    """Whether the engine's model has MoE layers (its config's `moe_layers`); a stand-in
    engine without a model has none."""
    return engine.model is not None and bool(engine.model.config.moe_layers)


def expert_load(engine) -> dict[int, list[int]]:
    """Tokens routed to each expert since start, by global MoE layer, over every pipeline
    stage (Stats `expert_tokens_l{layer}_e{expert}`). Empty for a model without MoE layers.
    Call on the engine loop's thread."""
    if not has_moe(engine):
        return {}
    out = routed_tokens(engine.model.stage if staged(engine) else engine.model)
    if staged(engine):  # the other pipeline stages
        for reply in engine.model.call("expert_load", lambda k: {}):
            if not reply.get("ok"):
                raise RuntimeError(f"a stage's expert load failed: {reply.get('error')}")
            out.update({int(k): v for k, v in reply["layers"].items()})
    return dict(sorted(out.items()))


def tracked_counters(*parts) -> dict[str, float]:
    """Stats counters `tracked_<name>`: the per-request bookkeeping of a worker's parts (any
    with a `tracked()` dict of sizes). Once the worker holds no request they are all back at
    0 (tests assert it after cancellations; busy threads: metric `baton_worker_threads`)."""
    out = {}
    for part in parts:
        tracked = getattr(part, "tracked", None)
        if tracked is not None:
            out.update({f"tracked_{k}": float(v) for k, v in tracked().items()})
    return out


def canary_audit(engine) -> dict[str, float]:
    """Read back every free block and slot on every stage (test canaries armed): how many
    were checked and how many lost their canary (a stray write landed there)."""
    cache = engine.cache
    blocks, slots = cache.free_ids()
    local = engine.pools.local if staged(engine) else engine.pools  # stage 0's own under PP
    bad_b, bad_s = set(bad_blocks(local, blocks)), set(bad_slots(local, slots))
    if staged(engine):  # the other pipeline stages
        for reply in engine.model.call("canaries", lambda k: {"blocks": blocks, "slots": slots}):
            if not reply.get("ok"):
                raise RuntimeError(f"a stage's canary audit failed: {reply.get('error')}")
            bad_b.update(reply.get("bad_blocks", ()))
            bad_s.update(reply.get("bad_slots", ()))
    if bad_b or bad_s:
        log.error("canaries: free blocks %s and free slots %s took a stray write",
                  sorted(bad_b), sorted(bad_s))
    return {"canary_blocks_checked": float(len(blocks)), "canary_slots_checked": float(len(slots)),
            "canary_bad_blocks": float(len(bad_b)), "canary_bad_slots": float(len(bad_s))}


def _pools_crc32(pools) -> int:
    crc = 0
    for t in pools.tensors:
        crc = zlib.crc32(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy(), crc)
    return crc
