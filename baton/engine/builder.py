"""Building an engine from a config: resolve the model, load it, allocate the pools once."""

from __future__ import annotations

import logging
import os

import torch

from baton.cache.manager import HybridCacheManager
from baton.config import BatonConfig
from baton.engine.engine import Engine
from baton.model.pools import Pools, PoolSpec

log = logging.getLogger("baton.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_engine(cfg: BatonConfig, model_path: str | None = None) -> Engine:
    from baton.model.loader import load_model
    from baton.model.registry import resolve_model
    from baton.model.tokenizer import load_tokenizer

    threads = os.environ.get("BATON_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    path = resolve_model(model_path or cfg.model.path)
    dtype = DTYPES[cfg.model.dtype]
    model = load_model(path, device=cfg.model.device, dtype=dtype)
    spec = PoolSpec.for_model(
        model.config,
        num_blocks=cfg.cache.num_blocks,
        tokens_per_block=cfg.cache.tokens_per_block,
        num_slots=cfg.cache.num_state_slots,
        dtype=dtype,
        device=cfg.model.device,
    )
    pools = Pools(spec)
    cache = HybridCacheManager(cfg.cache, pools, max_live=cfg.worker.max_num_seqs)
    log.info(
        "engine ready: model %s (%s), %d KV blocks x %d tokens, %d state slots, reuse %s",
        path, model.config.pattern, spec.num_blocks, spec.tokens_per_block, spec.num_slots,
        "on" if cache.reuse_enabled else "off",
    )
    return Engine(model, cache, cfg.worker, tokenizer=load_tokenizer(path))
