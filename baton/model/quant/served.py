"""What a worker serves, in words and bytes: the weight format (`stored_format`: the
checkpoint's quantized format, or its float dtype; `served_format`: with `model.quantize`
applied) and sizes. Torch-free (the router reads it for `/v1/models`)."""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from baton.model.quant.scheme import read_scheme


@dataclass(frozen=True)
class WeightInfo:
    """What an engine serves: the weight format, the bytes its weights take in this process,
    what they are held in (`packed fp8 and float32`: the kernels' packed weights beside the
    float ones; `float32`: a checkpoint decoded at load)."""

    format: str
    bytes: int
    dtype: str

    def __str__(self) -> str:
        return f"{self.format} ({self.bytes / 1e6:.1f} MB held in {self.dtype})"


QUANTIZE_GROUP = 32
QUANTIZE_LABELS = {"int8": "w8a16_channel", "int8g": f"w8a16_g{QUANTIZE_GROUP}",
                   "int4": f"w4a16_g{QUANTIZE_GROUP}"}
"""`model.quantize`'s served format per mode (what a written checkpoint's scheme is named)."""
FLOAT_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def _files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(path.glob("*.safetensors"))


def _header(file: Path) -> dict:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def stored_format(path: str | Path) -> str:
    """The checkpoint's weight format: its quantization scheme's label, else the float dtype
    most of its bytes are stored in (`bfloat16`, `float32`, ...)."""
    path = Path(path)
    scheme = read_scheme(path)
    if scheme is not None:
        return scheme.label
    size: Counter[str] = Counter()
    for file in _files(path):
        for name, h in _header(file).items():
            if name != "__metadata__":
                lo, hi = h["data_offsets"]
                size[h["dtype"]] += hi - lo
    dtype = size.most_common(1)[0][0] if size else "F32"
    return FLOAT_NAMES.get(dtype, dtype.lower())


def served_format(path: str | Path, quantize: str | None = None) -> str:
    """The format of the weights a worker computes with: `quantize`'s (int8 / int4) when
    set, else the checkpoint's."""
    return QUANTIZE_LABELS[quantize] if quantize else stored_format(path)


def checkpoint_bytes(path: str | Path) -> int:
    """Bytes of the checkpoint's tensors as stored."""
    total = 0
    for file in _files(Path(path)):
        total += sum(h["data_offsets"][1] - h["data_offsets"][0]
                     for k, h in _header(file).items() if k != "__metadata__")
    return total


def resident_bytes(module) -> int:
    """Bytes of a module's parameters and buffers in memory (tied tensors once)."""
    seen: dict[int, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def served_weights(path: str | Path, quantize: str | None = None) -> dict:
    """/v1/models' fields: the weight format served and the checkpoint's bytes as stored."""
    return {"weight_format": served_format(path, quantize),
            "checkpoint_bytes": checkpoint_bytes(path)}


def refuse_requantize(path: str | Path, quantize: str) -> None:
    """`model.quantize` on a checkpoint that is already quantized is refused (one line)."""
    scheme = read_scheme(Path(path))
    if scheme is not None:
        from baton.errors import ConfigError

        raise ConfigError(f"model.quantize={quantize!r} on {str(path)!r}, which is already "
                          f"quantized ({scheme.label}): unset model.quantize, or quantize its "
                          "float (bf16 / fp32) release")
