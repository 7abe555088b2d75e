"""The fast decode path's step kernels (`recurrent.cpp`: the Mamba2 and DeltaNet steps;
`attention.cpp`: paged attention, RMSNorm; `prefill.cpp`: a prompt's conv, gated norms and
SSD decay matrix, a prefill MoE block's experts one a thread; `gemm.cpp`: prefill's linears on
AVX2 machines; `layers.cpp`: a decode step's layers in one call over both modules' kernels),
compiled on first use
(`baton.model.layers.jit_build`).

`kernels()` is the compiled module, or None where it cannot be built (no compiler, not
x86-64, or `BATON_STEP_KERNELS=0`): the fast path then keeps its torch.compile'd steps
(`baton.model.layers.fused`). A failed build logs one line, once a process. Built for the
machine it runs on (`-march=native`; the cache folder's name includes the CPU's flags).
"""

from __future__ import annotations

from pathlib import Path

from baton import envs
from baton.model.layers import jit_build

HERE = Path(__file__).parent
BUILD = jit_build.KernelBuild(
    prefix="baton_step_", sources=(HERE / "recurrent.cpp", HERE / "attention.cpp",
                                  HERE / "glue.cpp", HERE / "prefill.cpp", HERE / "layers.cpp",
                                  HERE / "gemm.cpp"),
    headers=(HERE / "common.h", HERE / "kernels.h", HERE.parent / "cpu_kernels" / "gemv_api.h"),
    flags=("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"),
    switch=envs.STEP_KERNELS, label="step kernels", fallback="the compiled torch steps")
"""-ffp-contract=off: no FMA the source does not write, so sums round like the reference's
separate multiply and add; -fopenmp: at::parallel_for uses torch's thread pool, and the
`omp simd` reductions vectorise."""

_cache: dict[str, object] = {}


def kernels():
    """The compiled module, or None (see the module docstring); built once a process."""
    if "step" not in _cache:
        _cache["step"] = jit_build.load(BUILD)
    return _cache["step"]


def loaded():
    """The module if this process has built or imported it already, else None: for callers
    (greedy sampling) that should never be the ones to start a build."""
    return _cache.get("step")
