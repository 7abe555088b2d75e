"""Building and loading Baton's C++ CPU kernels (`cpu_kernels`, `step_kernels`) with torch's
JIT extension builder, once a machine.

A build is cached under `$TORCH_EXTENSIONS_DIR` (default ~/.cache/baton/torch_extensions), in
a folder named by a hash of its sources, torch's version, the flags and the Python version
(and the CPU's flags for a `-march=native` build), so a changed kernel builds afresh and
every process of a machine compiles it once. Processes starting together serialise on an
`flock` of `<folder>.lock` (released by the kernel when a holder dies, unlike torch's own lock
file, which a killed build leaves behind: under our lock a leftover one is stale and removed);
a finished build leaves `<name>.ok` and is then imported directly, without the builder. A
compile error leaves `<name>.failed`, so later processes do not pay for it again (delete it
to retry). Every failure is logged in one line, once a process, and the caller gets None.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from baton.envs import Env

log = logging.getLogger("baton.model")


@dataclass(frozen=True)
class KernelBuild:
    prefix: str
    """The module name's start (the hash follows)."""
    sources: tuple[Path, ...]
    headers: tuple[Path, ...]
    flags: tuple[str, ...]
    switch: Env
    """The switch (`baton.envs`) that turns it off when `0`."""
    label: str
    """What the log line calls it (`cpu kernels`)."""
    fallback: str
    """What runs instead (`torch's matmuls`), for the log line."""


PROGRESS_AFTER_S = 3.0
"""A build still running after this long says so in the log (and how long it took)."""


def cache_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "baton" / "torch_extensions"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name(b: KernelBuild) -> str:
    texts = [p.read_text() for p in (*b.sources, *b.headers)]
    native = _cpu() if "-march=native" in b.flags else ""
    key = "\n".join([*texts, torch.__version__, " ".join(b.flags), sys.version, native])
    return b.prefix + hashlib.sha256(key.encode()).hexdigest()[:12]


def load(b: KernelBuild):
    """The compiled module of `b`, or None (see the module docstring)."""
    if not b.switch.get():
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        log.info("baton %s: not built on %s, using %s", b.label, platform.machine(), b.fallback)
        return None
    try:
        name = build_name(b)
        folder = cache_root() / name
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held until the file closes (or the process dies)
            return _build_or_import(b, name, folder)
    except Exception as e:  # noqa: BLE001 - any failure means: keep the fallback
        line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        log.warning("baton %s unavailable (%s: %s): using %s", b.label, type(e).__name__, line,
                    b.fallback)
        return None


def _build_or_import(b: KernelBuild, name: str, folder: Path):
    done, failed = folder / f"{name}.ok", folder / f"{name}.failed"
    if done.is_file():
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.so")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if failed.is_file():  # a compile error does not go away: don't pay for it in every process
        raise RuntimeError(f"{failed.read_text().strip()} (delete {failed} to build again)")
    (folder / "lock").unlink(missing_ok=True)  # torch's, left by a build that was killed
    from torch.utils.cpp_extension import load as jit_load

    t0 = time.monotonic()
    # Progress only for a build that takes a while (a compiler that fails at once logs its one
    # failure line and nothing else).
    note = threading.Timer(PROGRESS_AFTER_S, log.warning, (
        "baton %s: compiling for this machine (once, about a minute; cached in %s)",
        b.label, folder))
    note.daemon = True
    note.start()
    includes = sorted({str(p.parent) for p in b.headers})
    try:
        module = jit_load(name=name, sources=[str(p) for p in b.sources],
                          extra_cflags=list(b.flags), extra_include_paths=includes,
                          extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    except RuntimeError as e:  # the compiler ran and failed (a missing one raises otherwise)
        failed.write_text((str(e).strip().splitlines() or ["build failed"])[0][:200] + "\n")
        raise
    finally:
        note.cancel()
    done.write_text("ok\n")
    if time.monotonic() - t0 >= PROGRESS_AFTER_S:
        log.warning("baton %s: compiled in %.0f s", b.label, time.monotonic() - t0)
    return module
