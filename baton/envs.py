"""Every `BATON_*` environment switch, typed and documented in one place.

A switch is read where it takes effect, through its `Env` here (never `os.environ` directly),
so `python -m baton.envs` lists them all. A setting a deployment chooses belongs in the
config file instead (`worker.torch_threads`, `cluster.token_file`, ...); what is left here is
debugging (the decode path, kernels off, allocator tuning off), what tests and benchmarks
pin, what Baton hands its own child processes, and secrets a deployment may prefer to pass
in the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Env(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        """The value in this process's environment now (the default when unset or empty)."""
        raw = os.environ.get(self.name, "")
        return self.default if raw == "" else self.parse(raw)

    def is_set(self) -> bool:
        return os.environ.get(self.name, "") != ""


def _modules(raw: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in raw.split(",") if m.strip())


ALL: list[Env] = []


def _env(name: str, default: T, parse: Callable[[str], T], doc: str) -> Env[T]:
    e = Env(name, default, parse, doc)
    ALL.append(e)
    return e


def _flag(raw: str) -> bool:
    return raw != "0"


def _decode_path(raw: str) -> str:
    if raw not in ("fast", "reference"):
        raise ValueError(f"BATON_DECODE_PATH must be 'fast' or 'reference', got {raw!r}")
    return raw


def _seconds(raw: str) -> float:
    try:
        return max(0.0, float(raw))
    except ValueError:
        return 0.0


# ---- process tuning (baton.startup) ------------------------------------------------------
MALLOC_TUNE = _env(
    "BATON_MALLOC_TUNE", True, _flag,
    "0: leave glibc's malloc thresholds alone (default: a prefill's freed temporaries stay on "
    "the heap; baton.startup).")
NUM_THREADS = _env(
    "BATON_NUM_THREADS", 0, int,
    "torch threads of an engine process where the config's `worker.torch_threads` is 0 (0 / "
    "unset: torch's default); `baton serve` sets it to split the cores between its workers, "
    "tests and benchmarks pin it; a tensor-parallel worker divides it between its ranks.")
LOG_LEVEL = _env(
    "BATON_LOG_LEVEL", "WARNING", str,
    "Log level of a pipeline stage or tensor-parallel rank process started bare.")

# ---- kernels and decode path -------------------------------------------------------------
DECODE_PATH = _env(
    "BATON_DECODE_PATH", "fast", _decode_path,
    "`reference`: decode on the unoptimised torch path (baton.model.layers.linear); `fast`.")
CPU_KERNELS = _env(
    "BATON_CPU_KERNELS", True, _flag,
    "0: do not build or use Baton's CPU matmul kernels (torch's matmuls instead).")
PACKED_WEIGHTS = _env(
    "BATON_PACKED_WEIGHTS", True, _flag,
    "0: decode a quantized checkpoint's weights into float32 at load (docs/quantization.md) "
    "instead of keeping them packed for the CPU kernels.")
STEP_KERNELS = _env(
    "BATON_STEP_KERNELS", True, _flag,
    "0: do not build or use the fused decode-step kernels (the compiled torch steps).")

# ---- models ------------------------------------------------------------------------------
CACHE_DIR = _env(
    "BATON_CACHE_DIR", "", str,
    "Where named test models are generated (default ~/.cache/baton).")
TRAINED_DIR = _env(
    "BATON_TRAINED_DIR", "", str,
    "Folder holding the trained named models' checkpoints, one subfolder per name (default "
    "baton/models_data; `make ship-models` fills it). Tests point it at probe checkpoints.")
FAMILY_MODULES = _env(
    "BATON_FAMILY_MODULES", (), _modules,
    "Comma-separated modules imported with the built-in families, each registering more "
    "(`baton.model.family.register`): a family kept outside baton/, e.g. a test's. Child "
    "processes (workers, stages, ranks) inherit it.")

# ---- security (the config file's keys do the same) ---------------------------------------
CLUSTER_TOKEN = _env(
    "BATON_CLUSTER_TOKEN", "", str,
    "The cluster secret (as `cluster.token_file`); `baton serve` sets it for its children.")
API_KEY = _env(
    "BATON_API_KEY", "", str,
    "One public API key the router accepts (beside `router.api_keys_file`); clients send it.")

# ---- set by Baton for its own child processes ----------------------------------------------
PP_CONFIG_JSON = _env(
    "BATON_PP_CONFIG_JSON", "", str,
    "A locally spawned stage's or rank's config: stage 0's, as JSON.")
PP_PARENT_PID = _env(
    "BATON_PP_PARENT_PID", 0, int,
    "A locally spawned stage or rank dies with this process (stage 0).")

# ---- tests only ----------------------------------------------------------------------------
TEST_CANARIES = _env(
    "BATON_TEST_CANARIES", False, lambda raw: raw == "1",
    "1: every freed KV block and state slot is overwritten with a canary the integrity check "
    "audits.")
TEST_TRANSFER_HOLD_S = _env(
    "BATON_TEST_TRANSFER_HOLD_S", 0.0, _seconds,
    "A transfer is reported done no sooner than this many seconds after it started (the "
    "chaos tests kill processes mid-transfer).")


def describe() -> str:
    return "\n".join(f"{e.name} (default {e.default!r}): {e.doc}" for e in ALL)


if __name__ == "__main__":
    print(describe())
