"""Building an engine from a config: resolve the model, load it, allocate the pools once."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import torch

from baton.cache.manager import HybridCacheManager
from baton.cache.value import FlopModel
from baton.config import BatonConfig
from baton.engine.engine import Engine
from baton.engine.speculative.setup import reserved_slots, with_draft_layers
from baton.errors import ConfigError
from baton.model.pools import Pools, PoolSpec

log = logging.getLogger("baton.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_engine(cfg: BatonConfig, model_path: str | None = None, stage_argv=None,
                 on_stage_death=None, pp_master: str | None = None,
                 on_link_lost=None) -> Engine:
    """The engine of a worker (stage 0 of it when `worker.pipeline_parallel_size` > 1: see
    `build_pipeline_engine` for the other arguments)."""
    from baton.model.loader import load_model
    from baton.model.registry import resolve_model
    from baton.model.tokenizer import load_tokenizer

    threads = os.environ.get("BATON_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    path = resolve_model(model_path or cfg.model.path)
    if cfg.worker.tensor_parallel_size > 1 and cfg.speculative.num_draft_tokens:
        raise ConfigError(
            f"speculative.num_draft_tokens={cfg.speculative.num_draft_tokens} is not "
            f"supported with worker.tensor_parallel_size={cfg.worker.tensor_parallel_size} "
            "yet; set it to 0 or use tensor_parallel_size 1")
    if cfg.worker.tensor_parallel_size > 1 or cfg.worker.pipeline_parallel_size > 1:
        from baton.cache.tiers import refuse_tiers

        refuse_tiers(cfg, "worker.tensor_parallel_size / pipeline_parallel_size > 1")
    if cfg.worker.tensor_parallel_size > 1 and cfg.worker.pipeline_parallel_size > 1:
        from baton.engine.tp.pp_model import build_tp_pipeline_engine

        return build_tp_pipeline_engine(cfg, path, on_stage_death, on_link_lost, stage_argv)
    if cfg.worker.tensor_parallel_size > 1:
        from baton.engine.tp.launch import build_tp_engine

        return build_tp_engine(cfg, path, on_stage_death, on_link_lost, stage_argv)
    if cfg.worker.pipeline_parallel_size > 1:
        return build_pipeline_engine(cfg, path, stage_argv, on_stage_death, pp_master,
                                     on_link_lost)
    dtype = DTYPES[cfg.model.dtype]
    model = load_model(path, device=cfg.model.device, dtype=dtype)
    if cfg.model.weight_dtype != "float32":
        from baton.model.layers.linear import cast_weights

        saved = cast_weights(model, DTYPES[cfg.model.weight_dtype])
        log.info("linear weights stored as %s (%.0f MB saved)", cfg.model.weight_dtype,
                 saved / 1e6)
    on_huge_pages(model, cfg.model.device)
    spec = PoolSpec.for_model(
        model.config,
        num_blocks=cfg.cache.num_blocks,
        tokens_per_block=cfg.cache.tokens_per_block,
        num_slots=cfg.cache.num_state_slots,
        dtype=dtype,
        device=cfg.model.device,
    )
    spec = with_draft_layers(spec, model, cfg.speculative)
    pools = Pools(spec)
    reserved = reserved_slots(cfg.speculative, spec.num_slots, cfg.worker.max_num_seqs)
    buckets = cfg.worker.decode_batch_buckets and getattr(model, "decode_takes_tables", False)
    cache = HybridCacheManager(cfg.cache, pools, max_live=cfg.worker.max_num_seqs,
                               reserved_slots=reserved, pad_rows=bool(buckets),
                               tiers=_tiers(cfg, pools, path), flops=_flops(cfg, model))
    _maybe_arm_canaries(cache)
    if buckets:
        log.info("decode steps padded to batch sizes %s (pad block %s, pad slot %s)",
                 list(cfg.worker.decode_batch_buckets), cache.pad_block, cache.pad_slot)
    log.info(
        "engine ready: model %s (%s, %s), %d KV blocks x %d tokens, %d state slots of %d bytes "
        "(%s; %d kept for speculation), reuse %s",
        path, model.config.family, model.config.pattern, spec.num_blocks, spec.tokens_per_block,
        spec.num_slots, spec.state_bytes_per_slot(),
        ", ".join(f"{t.name} {list(t.shape)}" for t in spec.state_tensors) or "no state",
        reserved, "on" if cache.reuse_enabled else "off",
    )
    return Engine(model, cache, cfg.worker, tokenizer=load_tokenizer(path),
                  speculative=cfg.speculative)


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


def on_huge_pages(model, device: str) -> None:
    """A CPU model's weights onto transparent huge pages (baton.model.hugepages)."""
    if torch.device(device).type == "cpu":
        from baton.model.hugepages import place_on_huge_pages

        moved = place_on_huge_pages(model)
        if moved:
            log.info("weights on transparent huge pages (%.0f MB)", moved / 1e6)


def _maybe_arm_canaries(cache: HybridCacheManager) -> None:
    from baton.cache import canary

    if canary.wanted():
        log.warning("test canaries armed (%s=1): every freed block and slot is overwritten",
                    canary.ENV)
        cache.arm_canaries()


def build_pipeline_engine(cfg: BatonConfig, path, stage_argv=None, on_stage_death=None,
                          pp_master: str | None = None, on_link_lost=None) -> Engine:
    """Stage 0 of a pipeline-parallel worker: joins (and hosts) the stages' process group,
    loads its own layers, and runs the scheduler and cache manager for every stage.

    `pp_master` None: start stages 1..N-1 here (`stage_argv(rank, master)`, default a bare
    stage process) and call `on_stage_death(rank, exit_code)` if one exits; else the stages
    are started elsewhere and join the store this stage hosts at that HOST:PORT.
    `on_link_lost(error)`: a message to or from another stage failed (it died, on any
    launcher); None: the forward's requests just fail.
    """
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
    from baton.model.tokenizer import load_tokenizer

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
        raise
    full = PoolSpec.for_model(stage.config, num_blocks=cfg.cache.num_blocks,
                              tokens_per_block=cfg.cache.tokens_per_block,
                              num_slots=cfg.cache.num_state_slots, dtype=local.spec.dtype,
                              device=cfg.model.device)
    # speculation: the MTP head (its weights and KV) is the last stage's; stage 0 accounts
    # for its KV layer and keeps the verify pass's scratch slots out of the cache manager
    head = mtp_head_meta(path) if cfg.speculative.num_draft_tokens else None
    full = with_draft_layers(full, SimpleNamespace(mtp=head, config=stage.config),
                             cfg.speculative)
    pools = MirroredPools(full, local)
    reserved = reserved_slots(cfg.speculative, full.num_slots, cfg.worker.max_num_seqs)
    cache = HybridCacheManager(cfg.cache, pools, max_live=cfg.worker.max_num_seqs,
                               reserved_slots=reserved)
    _maybe_arm_canaries(cache)  # the fills reach stages 1..N-1 as mirrored operations
    model = PipelineModel(stage, pools, Channel(0, size), layers, local_stages=stages,
                          on_link_lost=on_link_lost)
    model.mtp = head
    log.info("pipeline engine ready: %d stages, layers %s%s", size,
             [[r.start, r.stop] for r in layers],
             f", MTP head on stage {size - 1}" if head is not None else "")
    return Engine(model, cache, cfg.worker, tokenizer=load_tokenizer(path),
                  speculative=cfg.speculative)
