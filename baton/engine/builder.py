"""Building a worker's engine from a config, one way for every split of the model:

    split          model the engine drives         pools the cache manager sees
    1              the family's model              its own Pools
    PP N           PipelineModel (stage 0)         MirroredPools: every stage's layers
    TP N           TPModel (rank 0)                DigestPools: the rank's shard, mirrored
    TP N x PP M    TPPipelineModel (world rank 0)  LeaderPools: mirrored to stages and ranks

Each split's part (`_plain`, `_pipeline`, `_tensor_parallel`, `_tp_pipeline`) loads its
weights and pools and starts its other processes; the rest (the cache manager, canaries,
the engine) is written once in `build_engine`. Process mechanics live in
`pipeline/launch.py`, `tp/launch.py`, `tp/pipeline.py`; none of them imports this module.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import NamedTuple

import torch

from baton.cache.manager import HybridCacheManager
from baton.cache.state_format import check_built
from baton.cache.value import FlopModel
from baton.config import BatonConfig
from baton.engine.engine import Engine
from baton.engine.process import DTYPES, arm_canaries, on_huge_pages, rank_threads, set_threads
from baton.engine.speculative.setup import reserved_slots, with_draft_layers
from baton.engine.state_rounding import live_rounding, split_snapshots
from baton.errors import ConfigError
from baton.model.pools import Pools, PoolSpec

log = logging.getLogger("baton.engine")
tp_log = logging.getLogger("baton.tp")

__all__ = ["DTYPES", "build_engine", "on_huge_pages"]


class Built(NamedTuple):
    """One split's model and pools, before the cache manager."""

    model: object
    pools: Pools
    reserved: int = 0
    """State slots kept out of the cache manager (speculation's scratch)."""
    pad_rows: bool = False
    """The model takes bucketed decode steps (`Capabilities.decode_takes_tables`)."""
    kill: object = None
    """Stops the split's other processes if the engine cannot be finished."""


def build_engine(cfg: BatonConfig, model_path: str | None = None, stage_argv=None,
                 on_stage_death=None, pp_master: str | None = None,
                 on_link_lost=None) -> Engine:
    """The engine of a worker (rank 0 / stage 0 of it when the model is split).

    `stage_argv(rank, master)`: the command line of the split's other processes (default
    bare stages / ranks; a worker's run its role's transfer agent); `on_stage_death(rank,
    code)`: one of them exited; `pp_master` (PP only): the stages are started elsewhere and
    join the store this stage hosts at that HOST:PORT; `on_link_lost(error)`: a message to
    or from another process failed (None: the forward's requests just fail)."""
    from baton.model.registry import resolve_model
    from baton.model.tokenizer import load_tokenizer

    set_threads(cfg)
    path = resolve_model(model_path or cfg.model.path)
    tp, pp = cfg.worker.tensor_parallel_size, cfg.worker.pipeline_parallel_size
    if tp > 1 and cfg.speculative.num_draft_tokens:
        raise ConfigError(
            f"speculative.num_draft_tokens={cfg.speculative.num_draft_tokens} is not "
            f"supported with worker.tensor_parallel_size={tp} "
            "yet; set it to 0 or use tensor_parallel_size 1")
    if tp > 1 or pp > 1:
        from baton.cache.tiers import refuse_tiers

        refuse_tiers(cfg, "worker.tensor_parallel_size / pipeline_parallel_size > 1")
    for key in ("quantize_activations", "quantize_embeddings"):
        if getattr(cfg.model, key) and (tp > 1 or pp > 1):
            raise ConfigError(f"model.{key}={getattr(cfg.model, key)!r} runs in single-process "
                              f"workers only (tensor_parallel_size={tp}, "
                              f"pipeline_parallel_size={pp})")
    if cfg.model.quantize:
        from baton.model.quant.served import refuse_requantize

        refuse_requantize(path, cfg.model.quantize)
    if tp > 1 or pp > 1:  # refused before any rank or stage starts (nothing half-built runs)
        from baton.model.config import load_config

        _pool_spec(cfg, load_config(path), DTYPES[cfg.model.dtype])
    if tp > 1 and pp > 1:
        built = _tp_pipeline(cfg, path, on_stage_death, on_link_lost, stage_argv)
    elif tp > 1:
        built = _tensor_parallel(cfg, path, on_stage_death, on_link_lost, stage_argv)
    elif pp > 1:
        built = _pipeline(cfg, path, stage_argv, on_stage_death, pp_master, on_link_lost)
    else:
        built = _plain(cfg, path)
    cache = HybridCacheManager(cfg.cache, built.pools, max_live=cfg.worker.max_num_seqs,
                               reserved_slots=built.reserved, pad_rows=built.pad_rows,
                               tiers=_tiers(cfg, built.pools, path),
                               flops=_flops(cfg, built.model))
    arm_canaries(cache)  # split: the fills reach the other processes as mirrored operations
    if built.pad_rows:
        log.info("decode steps padded to batch sizes %s (pad block %s, pad slot %s)",
                 list(cfg.worker.decode_batch_buckets), cache.pad_block, cache.pad_slot)
    if tp == 1 and pp == 1:
        _int_activations(cfg, built.model)
    weights = _weights(path, cfg, built.model)
    if tp == 1 and pp == 1:
        _log_plain(path, built.model, built.pools.spec, built.reserved, cache, weights)
    else:
        log.info("weights: %s", weights)
    engine = Engine(built.model, cache, cfg.worker, tokenizer=load_tokenizer(path),
                    speculative=cfg.speculative)
    engine.weights = weights
    engine.rounding = live_rounding(cfg.cache, built.pools, DTYPES[cfg.model.dtype],
                                    cfg.model.device, built.model.config.state_tensors, tp, 0)
    return engine


def _int_activations(cfg: BatonConfig, model) -> None:
    """`model.quantize_activations`: every packed int8 / int4 weight marked for the CPU
    kernels' integer path (`quant.packed.mark_int_path`: per weight, so other models in the
    process keep theirs); refused in one line where it cannot apply (no such weights, not CPU
    float32, no kernel)."""
    from baton.model.layers import cpu_kernels
    from baton.model.quant import packed

    mode = cfg.model.quantize_activations
    if not mode:
        return
    held = [p for p in model.parameters() if packed.kind(p) in packed.INT_KINDS]
    why = ("no int8 / int4 weights are held (set model.quantize, or serve an int8 / "
           "W4A16 g32 checkpoint)" if not held
           else "it runs on CPU in float32" if (cfg.model.device != "cpu"
                                                 or cfg.model.dtype != "float32")
           else "Baton's CPU kernels are not built here" if cpu_kernels.gemv() is None
           else None)
    if why:
        raise ConfigError(f"model.quantize_activations={mode!r}: {why}")
    for p in held:
        packed.mark_int_path(p.data)
    log.info("model.quantize_activations %s: %d int8 / int4 weights dotted with int8 "
             "activations (per 32 columns; not exact against the dequantized weights)", mode,
             len(held))


def _packed_mode(cfg: BatonConfig) -> str | None:
    """How `model.quantize` packs: int8 per 32 columns (`packed` int8g, llama.cpp's Q8_0
    blocks) where the integer path computes with it, else as the written checkpoint does."""
    q = cfg.model.quantize
    return "int8g" if q == "int8" and cfg.model.quantize_activations else q


def _weights(path, cfg: BatonConfig, model):
    """The weight format served and the bytes held (this process's: a TP / PP worker's rank
    0 or stage 0)."""
    from baton.engine.pipeline.model import PipelineModel
    from baton.model.quant.served import WeightInfo, resident_bytes, served_format

    held = model.stage if isinstance(model, PipelineModel) else model  # TP / PP: this process's
    from baton.model.quant import packed

    kinds = sorted({packed.kind(p) for p in held.parameters()} - {None})
    held_as = f"packed {' / '.join(kinds)} and {cfg.model.dtype}" if kinds else cfg.model.dtype
    fmt = served_format(path, _packed_mode(cfg))
    if cfg.model.quantize_embeddings:  # other numerics: a P/D pair must agree on them too
        fmt += f"+{cfg.model.quantize_embeddings}_g32_embeddings"
    if cfg.model.quantize_activations:
        fmt += f"+{cfg.model.quantize_activations}_activations"
        held_as += f", {cfg.model.quantize_activations} activations"
    return WeightInfo(fmt, resident_bytes(held), held_as)


def _plain(cfg: BatonConfig, path) -> Built:
    from baton.model.loader import load_model

    dtype = DTYPES[cfg.model.dtype]
    # model.quantize: each weight packed as it is read (int8 / int4 in memory, read as
    # stored by the CPU kernels: baton/model/quant/packed.py)
    model = load_model(path, device=cfg.model.device, dtype=dtype, quantize=_packed_mode(cfg),
                       quantize_embeddings=cfg.model.quantize_embeddings)
    if cfg.model.weight_dtype != "float32":
        from baton.model.layers.linear import cast_weights

        saved = cast_weights(model, DTYPES[cfg.model.weight_dtype], lambda: model.dtype)
        log.info("linear weights stored as %s (%.0f MB saved)", cfg.model.weight_dtype,
                 saved / 1e6)
    on_huge_pages(model, cfg.model.device)
    spec = _pool_spec(cfg, model.config, dtype)
    spec = with_draft_layers(spec, model, cfg.speculative)
    reserved = reserved_slots(cfg.speculative, spec.num_slots, cfg.worker.max_num_seqs)
    buckets = bool(cfg.worker.decode_batch_buckets) and model.capabilities.decode_takes_tables
    return Built(model, Pools(split_snapshots(cfg, spec)), reserved, buckets)


def _log_plain(path, model, spec: PoolSpec, reserved: int, cache, weights) -> None:
    log.info(
        "engine ready: model %s (%s, %s), weights %s, %d KV blocks x %d tokens, %d state slots "
        "of %d bytes (%s; %d kept for speculation), reuse %s",
        path, model.config.family, model.config.pattern, weights, spec.num_blocks,
        spec.tokens_per_block,
        spec.num_slots, spec.state_bytes_per_slot(),
        ", ".join(f"{t.name} {list(t.shape)}" for t in spec.state_tensors) or "no state",
        reserved, "on" if cache.reuse_enabled else "off",
    )


def _pool_spec(cfg: BatonConfig, model_config, dtype) -> PoolSpec:
    """Every layer's pools (the whole model's, also under a split: the cache manager's)."""
    # issue 50: reduced-precision state rounds the live slots (every stage and rank alike)
    fmt = check_built(cfg.cache, model_config.state_tensors, dtype, cfg.model.device)
    return PoolSpec.for_model(model_config, num_blocks=cfg.cache.num_blocks,
                              tokens_per_block=cfg.cache.tokens_per_block,
                              num_slots=cfg.cache.num_state_slots, dtype=dtype,
                              device=cfg.model.device, kv_dtype=fmt.kv_dtype)


def _tiers(cfg: BatonConfig, pools: Pools, path):
    """The cache's disk and shared tiers (docs/cache-tiers.md), None when not configured."""
    from baton.auth.secret import configured_token
    from baton.cache.tiers import model_identity, open_tiers, wanted

    if not wanted(cfg.cache):
        return None
    return open_tiers(cfg.cache, pools, model_identity(path), configured_token(cfg.cluster))


def _flops(cfg: BatonConfig, model) -> FlopModel | None:
    """The model's FLOP counts where value-aware eviction scores snapshots by them."""
    return FlopModel.for_model(model.config) if cfg.cache.eviction.policy == "value" else None


def _pipeline(cfg: BatonConfig, path, stage_argv=None, on_stage_death=None,
              pp_master: str | None = None, on_link_lost=None) -> Built:
    """Stage 0 of a pipeline-parallel worker: joins (and hosts) the stages' process group,
    loads its own layers; its scheduler and cache manager run for every stage."""
    from baton.engine.pipeline.channel import Channel
    from baton.engine.pipeline.launch import (
        LocalStages,
        build_stage,
        engine_stage_argv,
        join_group,
        open_store,
        stage_layers,
    )
    from baton.engine.pipeline.mirror import MirroredPools
    from baton.engine.pipeline.model import PipelineModel
    from baton.model.loader import mtp_head_meta

    layers = stage_layers(cfg, path)
    size = len(layers)
    store = open_store(0, size, pp_master)
    stages = None
    if pp_master is None:
        argv = stage_argv or engine_stage_argv(str(path))
        stages = LocalStages(cfg, argv, f"127.0.0.1:{store.port}", size, on_stage_death)
    try:
        join_group(store, 0, size)
        stage, local = build_stage(cfg, path, layers, 0)
    except BaseException:
        if stages is not None:
            stages.kill()
        _leave_group()
        raise
    full = _pool_spec(cfg, stage.config, local.spec.dtype)
    # speculation: the MTP head (its weights and KV) is the last stage's; stage 0 accounts
    # for its KV layer and keeps the verify pass's scratch slots out of the cache manager
    head = mtp_head_meta(path) if cfg.speculative.num_draft_tokens else None
    full = with_draft_layers(full, SimpleNamespace(mtp=head, config=stage.config),
                             cfg.speculative)
    reserved = reserved_slots(cfg.speculative, full.num_slots, cfg.worker.max_num_seqs)
    pools = MirroredPools(split_snapshots(cfg, full), local)
    model = PipelineModel(stage, pools, Channel(0, size), layers, local_stages=stages,
                          on_link_lost=on_link_lost)
    model.mtp = head
    log.info("pipeline engine ready: %d stages, layers %s%s", size,
             [[r.start, r.stop] for r in layers],
             f", MTP head on stage {size - 1}" if head is not None else "")
    return Built(model, pools, reserved)


def _leave_group() -> None:
    """After a split failed to build (a refused shard, a rank that died): this process leaves
    the group it joined, so that nothing of the split is left (an engine built later in the
    process joins its own)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _tensor_parallel(cfg: BatonConfig, path, on_rank_death=None, on_link_lost=None,
                     rank_argv_of=None) -> Built:
    """Rank 0 of a tensor-parallel worker: starts ranks 1..N-1, joins their group, loads its
    shard; its scheduler and cache manager run for every rank."""
    from baton.engine.pipeline.channel import Channel
    from baton.engine.tp.launch import join, load_rank, rank_layout, start_ranks, state_precision
    from baton.engine.tp.model import DigestPools, TPModel

    size = cfg.worker.tensor_parallel_size
    threads = rank_threads(cfg, size)
    torch.set_num_threads(threads)
    store, ranks = start_ranks(cfg, path, on_rank_death, rank_argv_of)
    try:
        tp = join(0, size, store, cfg.model.device)
        shard, local = load_rank(cfg, path, tp)
        local = state_precision(cfg, shard, local, tp)
    except BaseException:
        ranks.kill()
        _leave_group()
        raise
    pools = DigestPools(local.spec, local)
    model = TPModel(shard, shard.full_config, pools, Channel(0, size), tp, ranks, on_link_lost)
    model.rank_layout = (f"tensor-parallel engine ready: TP {size} x PP 1 = {size} rank "
                         f"processes, {threads} torch thread(s) each\n"
                         f"{rank_layout(shard.full_config, size, ranks.pids())}")
    tp_log.info("%s", model.rank_layout)
    return Built(model, pools)


def _tp_pipeline(cfg: BatonConfig, path, on_rank_death=None, on_link_lost=None,
                 argv=None) -> Built:
    """World rank 0 (stage 0's leader) of a TP x PP worker; it starts every other rank."""
    from baton.engine.pipeline.channel import Channel
    from baton.engine.pipeline.launch import LocalStages, open_store
    from baton.engine.tp.launch import check_split, rank_layout, warn_cores
    from baton.engine.tp.pipeline import attach_leader, peer_ranks, setup, world_argv
    from baton.engine.tp.pp_model import LeaderPools, TPPipelineModel

    pp, tp = cfg.worker.pipeline_parallel_size, cfg.worker.tensor_parallel_size
    world = pp * tp
    threads = rank_threads(cfg, world)
    torch.set_num_threads(threads)
    check_split(cfg, path, tp)  # refused here, before any rank starts
    warn_cores(world, f"TP {tp} x PP {pp} = {world}")
    store = open_store(0, world, None)
    ranks = LocalStages(cfg, argv or world_argv(str(path)), f"127.0.0.1:{store.port}", world,
                        on_rank_death)
    try:
        _, shard, local, group, layers = setup(cfg, path, 0, store)
    except BaseException:
        ranks.kill()
        _leave_group()
        raise
    pools = LeaderPools(split_snapshots(cfg, _pool_spec(cfg, shard.config, local.spec.dtype)),
                        local)
    ch = Channel(0, pp)
    pools.lead = attach_leader(shard, local, ch, peer_ranks(0, pp, tp))
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
    tp_log.info("%s", model.rank_layout)
    return Built(model, pools)
