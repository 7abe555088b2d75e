"""Quantized checkpoints: the published formats read exactly (`scheme`, `checkpoint`,
`formats`); int8 / int4 / fp8 weights kept packed for the CPU kernels (`packed`), the others
dequantized into the model's dtype at load; see docs/quantization.md.

The loaders open checkpoint files through `open_file`, which presents a quantized checkpoint as
the float one it encodes and refuses, before any weight is read, anything it cannot decode
exactly."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only when a checkpoint is opened (the router reads `served`)
    from baton.model.quant.checkpoint import Checkpoint, FileView

__all__ = ["open_checkpoint", "open_file", "safe_open", "weight_format"]

_CACHE: dict[tuple, Checkpoint] = {}


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checked view of checkpoint directory `path` (cached while its files are unchanged)."""
    path = Path(path)
    key = (str(path.resolve()),) + tuple(
        (p.name, st.st_mtime_ns, st.st_size)
        for p in sorted(path.iterdir()) if p.suffix in (".json", ".safetensors")
        for st in [p.stat()])
    ckpt = _CACHE.get(key)
    if ckpt is None:
        from baton.model.quant.checkpoint import Checkpoint

        if len(_CACHE) > 8:
            _CACHE.clear()
        ckpt = _CACHE[key] = Checkpoint(path)
    return ckpt


def open_file(file: str | Path) -> FileView:
    """One safetensors file of a checkpoint, its tensors decoded (use as a context manager)."""
    file = Path(file)
    return open_checkpoint(file.parent).view(file)


def safe_open(file: str | Path, framework: str = "pt", device: str = "cpu") -> FileView:
    """`safetensors.safe_open`'s signature (the loaders call it so): `open_file`."""
    if (framework, device) != ("pt", "cpu"):
        raise ValueError(f"quantized checkpoints are read as pt on cpu, not {framework}/{device}")
    return open_file(file)


def weight_format(path: str | Path) -> str | None:
    """The quantized format the checkpoint at `path` stores, None when it is unquantized."""
    return open_checkpoint(path).label
