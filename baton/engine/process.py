"""What an engine process sets up before its first forward, whichever way the model is split:
dtype names, torch threads, weights on huge pages, test canaries. A leaf: the builder and
the stage and rank launchers import it, never each other's internals."""

from __future__ import annotations

import logging
import os

import torch

from baton import envs

log = logging.getLogger("baton.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def threads_of(cfg) -> int:
    """The engine's torch threads: `worker.torch_threads`, else BATON_NUM_THREADS; 0:
    torch's default."""
    return cfg.worker.torch_threads or envs.NUM_THREADS.get()


def set_threads(cfg) -> None:
    """torch's intra-op threads (`threads_of`; 0: torch's default)."""
    threads = threads_of(cfg)
    if threads:
        torch.set_num_threads(threads)


def rank_threads(cfg, size: int) -> int:
    """Each of `size` rank processes' share of the cores (or of `threads_of`), so TP 1 and
    TP N use the same total."""
    total = threads_of(cfg) or os.cpu_count() or 1
    return max(1, total // size)


def on_huge_pages(model, device: str) -> None:
    """A CPU model's weights onto transparent huge pages (baton.model.hugepages)."""
    if torch.device(device).type == "cpu":
        from baton.model.hugepages import place_on_huge_pages

        moved = place_on_huge_pages(model)
        if moved:
            log.info("weights on transparent huge pages (%.0f MB)", moved / 1e6)


def arm_canaries(cache) -> None:
    """Test canaries in every free block and slot, when BATON_TEST_CANARIES asks."""
    from baton.cache import canary

    if canary.wanted():
        log.warning("test canaries armed (%s=1): every freed block and slot is overwritten",
                    canary.ENV)
        cache.arm_canaries()
