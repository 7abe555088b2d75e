"""Baton's C++ CPU kernels, compiled on first use with torch's JIT extension builder.

`gemv()` is the module of `gemv.cpp` (decode-sized linears with a fixed accumulation order,
see that file), or None where it cannot be built (no compiler, not x86-64, or
`BATON_CPU_KERNELS=0`): the caller then keeps torch's matmuls. A failed build logs one line,
once a process.

The build is cached under `$TORCH_EXTENSIONS_DIR` (default ~/.cache/baton/torch_extensions), in
a folder named by a hash of the source, torch's version, the flags and the Python version, so
a changed kernel builds afresh and every process of a machine compiles it once. Processes
starting together serialise on an `flock` of `<folder>.lock` (released by the kernel when a
holder dies, unlike torch's own lock file, which a killed build leaves behind: under our lock a
leftover one is stale and removed); a finished build leaves `<name>.ok` and is then imported
directly, without running the builder.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path

import torch

log = logging.getLogger("baton.model")

SOURCE = Path(__file__).with_name("gemv.cpp")
SOURCES = (SOURCE, *(SOURCE.with_name(h) for h in ("gemv_kernels.h", "gemv_avx2.h")))
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
"""No -march: each kernel carries its own target attribute and is chosen at run time, so a
build runs on any x86-64. -fopenmp makes at::parallel_for use torch's OpenMP pool; fp
contraction stays off so nothing but the kernel's explicit FMAs fuses."""

_cache: dict[str, object] = {}


def cache_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "baton" / "torch_extensions"


def build_name() -> str:
    key = "\n".join([*(p.read_text() for p in SOURCES), torch.__version__, " ".join(FLAGS), sys.version])
    return "baton_gemv_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def gemv():
    """The compiled kernel module, or None (see the module docstring); built once a process."""
    if "gemv" not in _cache:
        _cache["gemv"] = _load()
    return _cache["gemv"]


def _load():
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        log.info("baton cpu kernels: not built on %s, using torch's matmuls", platform.machine())
        return None
    name = build_name()
    folder = cache_root() / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held until the file closes (or the process dies)
            return _build_or_import(name, folder)
    except Exception as e:  # noqa: BLE001 - any failure means: keep torch's path
        line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        log.warning("baton cpu kernels unavailable (%s: %s): using torch's matmuls",
                    type(e).__name__, line)
        return None


def _build_or_import(name: str, folder: Path):
    done, failed = folder / f"{name}.ok", folder / f"{name}.failed"
    if done.is_file():
        return _import(name, folder / f"{name}.so")
    if failed.is_file():  # a compile error does not go away: don't pay for it in every process
        raise RuntimeError(f"{failed.read_text().strip()} (delete {failed} to build again)")
    (folder / "lock").unlink(missing_ok=True)  # torch's, left by a build that was killed
    from torch.utils.cpp_extension import load

    try:
        module = load(name=name, sources=[str(SOURCE)], extra_cflags=FLAGS,
                      extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    except RuntimeError as e:  # the compiler ran and failed (a missing one raises otherwise)
        failed.write_text((str(e).strip().splitlines() or ["build failed"])[0][:200] + "\n")
        raise
    done.write_text(module.isa() + "\n")
    return module


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
