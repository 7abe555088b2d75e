"""Helpers shared by benchmarks: seeded checkpoints in the cache folder, prompts, timers."""

from __future__ import annotations

import os
import random
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))


def checkpoint(preset: str, family: str = "nemotron_h") -> Path:
    """The benchmark model for `preset` (`tiny` or `100m`) of `family`, written once into the
    cache folder."""
    from baton.model.registry import resolve_model

    if preset == "tiny":
        return Path(resolve_model("tiny" if family == "nemotron_h" else f"{family}-tiny"))
    from baton.model.make_model import write_checkpoint

    name = f"bench-{preset}-v1" if family == "nemotron_h" else f"bench-{family}-{preset}-v1"
    path = cache_dir() / name
    if not (path / "config.json").is_file():
        write_checkpoint(path, preset=preset, seed=1, family=family)
    return path


def decode_engine(path, batch: int, seq_len: int, max_batch_tokens: int = 4096,
                  weight_dtype: str = "float32"):
    """An engine for `batch` sequences of up to `seq_len` tokens each, prefix reuse off (what
    the decode benchmarks time)."""
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine

    cfg = BatonConfig.from_dict({
        "model": {"weight_dtype": weight_dtype},
        "cache": {"enable_prefix_reuse": False, "num_blocks": batch * (seq_len // 16 + 2) + 16,
                  "num_state_slots": batch + 1},
        "worker": {"max_num_seqs": batch, "max_batch_tokens": max_batch_tokens,
                   "prefill_chunk_size": 2048, "max_model_len": seq_len + 1},
    })
    return build_engine(cfg, str(path))


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (/proc/PID/stat 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int]) -> None:
    """Pins every thread of process `pid` to `cpus`; threads it starts later inherit that."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            pass


def runqueue_wait_seconds(pid: int) -> float:
    """Seconds the live threads of process `pid` spent runnable but waiting for a CPU
    (second field of /proc/PID/task/TID/schedstat): what other processes on its cores cost it."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError):  # the thread ended meanwhile
            pass
    return total / 1e9


def worker_stats(stub, bearer: str) -> list[tuple[str, dict[str, float]]]:
    """(role, Stats counters) of every worker the router lists ("prefill" / "decode"), asked
    with the cluster's bearer."""
    import grpc

    from baton.auth.grpc_auth import authorized
    from baton.proto_gen import baton_pb2, router_pb2, worker_pb2_grpc

    out = []
    for w in stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers:
        prefill = w.role == baton_pb2.WORKER_ROLE_PREFILL
        with authorized(grpc.insecure_channel(w.address), bearer) as ch:
            cls = worker_pb2_grpc.PrefillWorkerStub if prefill else worker_pb2_grpc.DecodeWorkerStub
            c = cls(ch).Stats(baton_pb2.StatsRequest(), timeout=10).counters
        out.append(("prefill" if prefill else "decode", dict(c)))
    return out
