"""Starting a tensor-parallel worker: rank processes (the pipeline's `LocalStages`, dying with
rank 0), one gloo group for control plus a second one for the layers' collectives (so a
control send never interleaves with an all-reduce), threads split between the ranks, the
rank layout printed, and each rank's shard of weights and pools.

Threads: the machine's cores (or `worker.torch_threads` / BATON_NUM_THREADS) are divided between the ranks, so TP 1
and TP N use the same total. More ranks than cores is allowed, with one warning.
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
from baton.config import BatonConfig
from baton.engine.pipeline.launch import (
    LocalStages,
    _die_with_parent,
    config_from_env,
    join_group,
    open_store,
)
from baton.engine.process import DTYPES, rank_threads
from baton.model import family
from baton.model.config import load_config
from baton.model.layers.parallel import TPGroup, collective_backend, rank_device
from baton.model.tp_shard import held_units

log = logging.getLogger("baton.tp")


def rank_layout(cfg, size: int, pids: dict[int, int]) -> str:
    """One line per rank: what of the model it holds."""
    parts = []
    for r in range(size):
        what = [f"vocab {_rng(cfg.vocab_size, size, r)}"]
        if cfg.attention_layers:
            what += [f"attention heads {_rng(cfg.num_attention_heads, size, r)}",
                     f"KV heads {_rng(cfg.num_key_value_heads, size, r)}"]
        what += [f"{label} {_rng(units, size, r)}" for label, units in cfg.tp_layout()]
        role = " (scheduler + cache manager)" if r == 0 else ""
        parts.append(f"  rank {r} pid {pids.get(r, os.getpid())}{role}: {', '.join(what)}")
    return "\n".join(parts)


def _rng(units: int, size: int, r: int) -> str:
    lo, hi = held_units(units, size, r)
    rep = "" if units % size == 0 else f" (replicated x{size // units})"
    return f"[{lo}, {hi}){rep}"


def warn_cores(size: int, what: str = "") -> None:
    cores = os.cpu_count() or 1
    if size > cores:
        log.warning("%s rank processes on %d cores: ranks share cores (correct, not faster)",
                    what or f"tensor_parallel_size={size}", cores)


def join(rank: int, size: int, store, device: str = "cpu") -> TPGroup:
    """The control group (p2p, gloo) and the collectives' group (gloo, or NCCL for CUDA
    ranks): every rank calls this in order."""
    join_group(store, rank, size)
    backend = collective_backend(device)
    return TPGroup(rank, size, dist.new_group(list(range(size)), backend=backend),
                   backend=backend)


def load_rank(cfg: BatonConfig, path, tp: TPGroup):
    """(the rank's model, its pools)."""
    from baton.cache.state_format import kv_dtype
    from baton.model.tp_loader import load_tp_model

    model = load_tp_model(path, tp, device=rank_device(cfg.model.device, tp.rank),
                          dtype=DTYPES[cfg.model.dtype],
                          moe_split=cfg.worker.moe_tp_split, quantize=cfg.model.quantize)
    pools = model.make_pools(cfg.cache.num_blocks, cfg.cache.tokens_per_block,
                             cfg.cache.num_state_slots,
                             kv_dtype(cfg.cache, DTYPES[cfg.model.dtype], cfg.model.device))
    return model, pools


def state_precision(cfg: BatonConfig, model, pools, tp: TPGroup):
    """A rank's pools with 16-bit snapshot slots and the rounding it mirrors from rank 0
    (docs/state-precision.md): the same split on every rank; its shard's elements keyed by
    their TP 1 index. Unchanged (no rounding) with the model's state dtype."""
    from baton.engine.state_rounding import live_rounding, split_snapshots
    from baton.model.pools import Pools

    split = split_snapshots(cfg, pools.spec)
    if split is not pools.spec:
        pools = Pools(split)
    pools.rounding = live_rounding(cfg.cache, pools, DTYPES[cfg.model.dtype], cfg.model.device,
                                   model.full_config.state_tensors, tp.size, tp.rank)
    return pools


def check_split(cfg: BatonConfig, path, tp: int) -> None:
    """ConfigError in one line if the model cannot be split over `tp` ranks."""
    mcfg = load_config(path)
    family.of(mcfg).tp_module().local_config(mcfg, tp, cfg.worker.moe_tp_split)


def rank_argv(model_path: str):
    return lambda rank, master: [sys.executable, "-m", "baton.engine.tp.launch",
                                 str(model_path), str(rank), master]


def start_ranks(cfg: BatonConfig, path, on_death=None, argv=None):
    """(store, the rank processes 1..N-1) after checking the model splits; `argv(rank,
    master)`: a rank's command line (default a bare rank; a worker's ranks run its role's
    transfer agent: `baton <role>-worker --pp-rank R --pp-master M`)."""
    size = cfg.worker.tensor_parallel_size
    check_split(cfg, path, size)  # refused here, before any rank starts
    warn_cores(size)
    store = open_store(0, size, None)
    ranks = LocalStages(cfg, argv or rank_argv(str(path)), f"127.0.0.1:{store.port}", size,
                        on_death)
    return store, ranks


def serve_rank(cfg: BatonConfig, model_path, rank: int, master: str,
               make_handlers=None) -> int:
    """Rank `rank` (1..N-1): join the group, load its shard, obey rank 0 until "stop";
    `make_handlers(model, pools, channel)`: a worker role's control handlers (its rank's
    transfer agent)."""
    from baton.engine.pipeline.channel import Channel
    from baton.engine.tp.rank import TPRankLoop

    _die_with_parent()
    size = cfg.worker.tensor_parallel_size
    torch.set_num_threads(rank_threads(cfg, size))
    store = open_store(rank, size, master)
    tp = join(rank, size, store, cfg.model.device)
    model, pools = load_rank(cfg, model_path, tp)
    pools = state_precision(cfg, model, pools, tp)
    ch = Channel(rank, size)
    handlers = make_handlers(model, pools, ch) if make_handlers is not None else None
    log.info("tensor-parallel rank %d/%d ready", rank, size)
    try:
        TPRankLoop(model, pools, ch, tp, handlers).run()
    except Exception as e:  # noqa: BLE001 - rank 0 is gone or a forward failed: leave
        log.warning("tensor-parallel rank %d: leaving (%s)", rank, e)
        return 1
    return 0


def main(argv: list[str]) -> int:
    """`python -m baton.engine.tp.launch MODEL RANK MASTER` (config in the env)."""
    logging.basicConfig(level=envs.LOG_LEVEL.get())
    code = serve_rank(config_from_env(None), argv[0], int(argv[1]), argv[2])
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
