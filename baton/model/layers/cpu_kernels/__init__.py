"""Baton's C++ CPU linear kernel, compiled on first use (`baton.model.layers.jit_build`).

`gemv()` is the module of `gemv.cpp` (decode-sized linears with a fixed accumulation order,
see that file), or None where it cannot be built (no compiler, not x86-64, or
`BATON_CPU_KERNELS=0`): the caller then keeps torch's matmuls. A failed build logs one line,
once a process.
"""

from __future__ import annotations

from pathlib import Path

from baton import envs
from baton.model.layers import jit_build

HERE = Path(__file__).parent
SOURCE = HERE / "gemv.cpp"
BUILD = jit_build.KernelBuild(
    prefix="baton_gemv_", sources=(SOURCE,),
    headers=(HERE / "gemv_common.h", HERE / "gemv_glue.h", HERE / "gemv_moe.h", HERE / "gemv_route.h",
             HERE / "gemv_kernels.h", HERE / "gemv_avx2.h", HERE / "gemv_int.h", HERE / "gemv_api.h"),
    flags=("-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"),
    switch=envs.CPU_KERNELS, label="cpu kernels", fallback="torch's matmuls")
"""No -march: each kernel carries its own target attribute and is chosen at run time, so a
build runs on any x86-64. -fopenmp makes at::parallel_for use torch's OpenMP pool; fp
contraction stays off so nothing but the kernel's explicit FMAs fuses."""

_cache: dict[str, object] = {}


def gemv():
    """The compiled kernel module, or None (see the module docstring); built once a process."""
    if "gemv" not in _cache:
        _cache["gemv"] = jit_build.load(BUILD)
    return _cache["gemv"]
