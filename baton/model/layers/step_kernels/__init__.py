"""The fast decode path's step kernels (`recurrent.cpp`: the Mamba2 and DeltaNet steps;
`attention.cpp`: paged attention, RMSNorm), compiled on first use with torch's JIT extension
builder.

`kernels()` is the compiled module, or None where it cannot be built (no compiler, not
x86-64, or `BATON_STEP_KERNELS=0`): the fast path then keeps its torch.compile'd steps
(`baton.model.layers.fused`). A failed build logs one line, once a process.

The build is cached under `$TORCH_EXTENSIONS_DIR` (default ~/.cache/baton/torch_extensions) in a
folder named by a hash of the source, torch's version, the flags, the Python version and the
CPU (it is built for the machine it runs on: `-march=native`), so a changed kernel builds afresh
and every process of a machine compiles it once; processes starting together serialise on an
`flock` (a killed build leaves no lock behind), and a finished build (`<name>.ok`) is imported
directly, without the builder.
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

HERE = Path(__file__).parent
SOURCES = [HERE / "recurrent.cpp", HERE / "attention.cpp"]
HEADERS = [HERE / "common.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
"""-ffp-contract=off: no FMA the source does not write, so sums round like the reference's
separate multiply and add; -fopenmp: at::parallel_for uses torch's thread pool, and the
`omp simd` reductions vectorise."""

_cache: dict[str, object] = {}


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


def build_name() -> str:
    texts = [p.read_text() for p in SOURCES + HEADERS]
    key = "\n".join([*texts, torch.__version__, " ".join(FLAGS), sys.version, _cpu()])
    return "baton_step_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def kernels():
    """The compiled module, or None (see the module docstring); built once a process."""
    if "step" not in _cache:
        _cache["step"] = _load()
    return _cache["step"]


def _load():
    if os.environ.get("BATON_STEP_KERNELS", "1") == "0":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        name = build_name()
        folder = cache_root() / name
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held until the file closes (or the process dies)
            return _build_or_import(name, folder)
    except Exception as e:  # noqa: BLE001 - any failure means: keep the compiled torch steps
        line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        log.warning("baton step kernels unavailable (%s: %s): using the compiled torch steps",
                    type(e).__name__, line)
        return None


def _build_or_import(name: str, folder: Path):
    done = folder / f"{name}.ok"
    if done.is_file():
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.so")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    (folder / "lock").unlink(missing_ok=True)  # torch's, left by a build that was killed
    from torch.utils.cpp_extension import load

    module = load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=FLAGS,
                  extra_include_paths=[str(HERE)], extra_ldflags=["-fopenmp"],
                  build_directory=str(folder), verbose=False)
    done.write_text("ok\n")
    return module
