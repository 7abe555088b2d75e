"""Starting a pipeline: the gloo process group, the local stage processes, one stage's
weights and pools, and the loop of a stage other than 0.

By default stage 0 starts stages 1..N-1 itself (`LocalStages`), each a child process that
dies with it (PR_SET_PDEATHSIG, armed by the child) and is watched: a stage that exits takes the worker down.
Launchers that place stages on other hosts start each stage with `--pp-rank R
--pp-master HOST:PORT` (stage 0 hosts the rendezvous store at that address).
"""

from __future__ import annotations

import baton.startup  # noqa: F401 - first: this module is a process's entry point

# isort: split

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from baton import envs
from baton.config import BatonConfig
from baton.config.base import to_dict
from baton.engine.process import set_threads
from baton.model.config import load_config
from baton.model.partition import partition_layers
from baton.model.pools import Pools, PoolSpec
from baton.model.protocol import Stage

log = logging.getLogger("baton.pipeline")

CONFIG_ENV = envs.PP_CONFIG_JSON.name
"""A locally spawned stage's config (stage 0's, as JSON): identical on every stage."""
PARENT_ENV = envs.PP_PARENT_PID.name
"""Set on locally spawned stages: the stage dies with this process (stage 0)."""
GROUP_TIMEOUT = timedelta(seconds=600)


def stage_layers(cfg: BatonConfig, model_path) -> list[range]:
    mcfg = load_config(model_path)
    w = cfg.worker
    return partition_layers(mcfg.num_layers, w.pipeline_parallel_size, w.pp_layer_partition)


def open_store(rank: int, size: int, master: str | None) -> dist.TCPStore:
    """Stage 0 hosts the rendezvous store (on a free port when `master` is None)."""
    host, port = ("127.0.0.1", 0) if master is None else _split(master)
    return dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timedelta(seconds=120),
                         wait_for_workers=False)


def join_group(store: dist.TCPStore, rank: int, size: int) -> None:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                            timeout=GROUP_TIMEOUT)


def build_stage(cfg: BatonConfig, model_path, layers: list[range], rank: int
                ) -> tuple[Stage, Pools]:
    """One stage's weights and pools. With speculation on, the last stage also holds the
    MTP head (and the embeddings it reads) and the head's KV as a layer of its KV pool."""
    from baton.cache.state_format import kv_dtype
    from baton.engine.process import DTYPES, on_huge_pages
    from baton.engine.speculative.setup import with_draft_layers
    from baton.engine.state_rounding import live_rounding, split_snapshots
    from baton.model.loader import load_stage

    dtype = DTYPES[cfg.model.dtype]
    last = rank == len(layers) - 1
    model = load_stage(model_path, layers[rank], rank == 0, last, device=cfg.model.device,
                       dtype=dtype, mtp=bool(cfg.speculative.num_draft_tokens),
                       quantize=cfg.model.quantize)
    on_huge_pages(model, cfg.model.device)
    spec = PoolSpec.for_model(model.config, num_blocks=cfg.cache.num_blocks,
                              tokens_per_block=cfg.cache.tokens_per_block,
                              num_slots=cfg.cache.num_state_slots, layers=layers[rank],
                              dtype=dtype, device=cfg.model.device,
                              kv_dtype=kv_dtype(cfg.cache, dtype, cfg.model.device))
    if model.mtp is not None:
        spec = with_draft_layers(spec, model, cfg.speculative, cfg.cache.num_blocks)
    pools = Pools(split_snapshots(cfg, spec))  # 16-bit snapshots: the same split everywhere
    # rounds its layers as stage 0 records it (mirrored "round" ops; engine/state_rounding.py)
    pools.rounding = live_rounding(cfg.cache, pools, dtype, cfg.model.device)
    return model, pools


StageArgv = Callable[[int, str], list[str]]
"""(rank, master HOST:PORT) -> the command line of that stage's process."""


def engine_stage_argv(model_path: str) -> StageArgv:
    """A bare stage (no transfer agent): `python -m baton.engine.pipeline.launch`."""
    return lambda rank, master: [sys.executable, "-m", "baton.engine.pipeline.launch",
                                 str(model_path), str(rank), master]


class LocalStages:
    """Stages 1..N-1 as child processes of stage 0; `on_death(rank, code)` runs (once, on a
    watcher thread) if one exits before `stop`."""

    def __init__(self, cfg: BatonConfig, argv: StageArgv, master: str, size: int,
                 on_death: Callable[[int, int], None] | None = None):
        env = {**os.environ, CONFIG_ENV: json.dumps(to_dict(cfg)), PARENT_ENV: str(os.getpid())}
        self.procs = {r: subprocess.Popen(argv(r, master), env=env) for r in range(1, size)}
        self.on_death = on_death
        self._stopping = False
        threading.Thread(target=self._watch, name="pp-stage-watch", daemon=True).start()

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        self._stopping = True
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()

    def _watch(self) -> None:
        while not self._stopping:
            for r, p in self.procs.items():
                code = p.poll()
                if code is not None and not self._stopping:
                    log.error("pipeline stage %d (pid %d) exited with %s", r, p.pid, code)
                    self.kill()
                    if self.on_death is not None:
                        self.on_death(r, code)
                    return
            time.sleep(0.1)


def serve_stage(cfg: BatonConfig, model_path, rank: int, master: str,
                make_handlers: Callable | None = None) -> int:
    """A stage other than 0: join the group, load its layers, obey stage 0 until "stop"."""
    from baton.engine.pipeline.channel import Channel
    from baton.engine.pipeline.stage import StageLoop

    _die_with_parent()
    set_threads(cfg)
    layers = stage_layers(cfg, model_path)
    size = len(layers)
    store = open_store(rank, size, master)
    join_group(store, rank, size)
    model, pools = build_stage(cfg, model_path, layers, rank)
    ch = Channel(rank, size)
    handlers = make_handlers(model, pools, ch) if make_handlers is not None else {}
    log.info("pipeline stage %d/%d ready: layers %s", rank, size, list(layers[rank]))
    try:
        StageLoop(model, pools, ch, handlers).run()
    except Exception as e:  # noqa: BLE001 - stage 0 is gone: nothing left to serve
        log.warning("pipeline stage %d: the group broke (%s); exiting", rank, e)
        return 1
    return 0


def config_from_env(path: str | None) -> BatonConfig:
    data = envs.PP_CONFIG_JSON.get()
    return BatonConfig.from_dict(json.loads(data)) if data else BatonConfig.load(path)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _die_with_parent() -> None:
    """A stage that stage 0 spawned gets SIGKILL when stage 0 dies (no orphaned stages), and
    leaves at once if stage 0 died before that was armed."""
    parent = envs.PP_PARENT_PID.get()
    if not parent:
        return  # started by a launcher: the broken process group ends it
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def main(argv: list[str]) -> int:
    """`python -m baton.engine.pipeline.launch MODEL RANK MASTER` (config in the env)."""
    logging.basicConfig(level=envs.LOG_LEVEL.get())
    model_path, rank, master = argv[0], int(argv[1]), argv[2]
    code = serve_stage(config_from_env(None), model_path, rank, master)
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
