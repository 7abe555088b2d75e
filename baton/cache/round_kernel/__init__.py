"""The fused stochastic rounding kernel (`round.cpp`: float32 -> bfloat16, the same bits as
`baton.cache.rounding`'s torch reference, in one pass), compiled on first use
(`baton.model.layers.jit_build`). `kernel()` is the module, or None where it cannot be built
(or `BATON_STEP_KERNELS=0`): the torch reference then rounds."""

from __future__ import annotations

from pathlib import Path

from baton import envs
from baton.model.layers import jit_build

HERE = Path(__file__).parent
BUILD = jit_build.KernelBuild(
    prefix="baton_round_", sources=(HERE / "round.cpp",), headers=(),
    flags=("-O3", "-fopenmp"), switch=envs.STEP_KERNELS, label="rounding kernel",
    fallback="the torch reference")

_cache: dict[str, object] = {}


def kernel():
    """The compiled module, or None; built once a process."""
    if "round" not in _cache:
        _cache["round"] = jit_build.load(BUILD)
    return _cache["round"]
