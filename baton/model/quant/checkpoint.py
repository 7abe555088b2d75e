"""A quantized checkpoint seen as the float checkpoint it encodes.

`open_file(file)` is what the loaders open instead of `safetensors.safe_open`: its `keys()`
name the logical tensors (`X.weight`, never `X.weight_scale_inv` or `X.weight_packed`), and
`get_tensor` / `get_slice` decode a quantized weight exactly into float32 (the loader then
casts it to the model's dtype). A slice (a tensor-parallel shard, one expert's rows) reads only
its part of the stored bytes and of the scales; a slice that would cut a scale block is refused
naming the sizes.

The whole checkpoint is checked when it is first opened, before any weight is read: every
low-precision tensor has its scales, of the shape the format gives; nothing low-precision sits
in a module its config leaves unquantized; nothing low-precision is in a checkpoint that
declares no quantization. A failure is one ConfigError line naming the tensor, its shape or
value and the limit, so nothing half-loaded ever runs. Activation and KV-cache scales
(`input_scale`, `k_scale`, `v_scale`) are noted once in the log and not used: Baton computes
weight-only, in the model's dtype.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from baton.errors import ConfigError
from baton.model.quant import formats
from baton.model.quant.scheme import Rule, Scheme, read_scheme

log = logging.getLogger("baton.model")

WEIGHT_PARTS = ("weight_scale_inv", "weight_scale_2", "weight_scale", "weight_zero_point",
                "weight_shape", "weight_g_idx", "weight_global_scale", "weight_packed")
NOTED = ("input_scale", "k_scale", "v_scale", "activation_scale", "input_global_scale")
"""Activation / KV-cache scales: read past, counted once in the log."""
LOW = ("F8_E4M3", "F8_E5M2", "U8", "I8", "I16", "I32", "I4", "F4")
"""safetensors dtypes a weight is never stored in unquantized."""
FLOAT = ("F32", "BF16", "F16")
KIND_DTYPE = {"fp8_block": "F8_E4M3", "fp8_tensor": "F8_E4M3", "fp8_channel": "F8_E4M3",
              "nvfp4": "U8", "ct_nvfp4": "U8", "int": "I8", "packed": "I32"}


@dataclass(frozen=True)
class Meta:
    file: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}
        return math.prod(self.shape) * size.get(self.dtype, 1)


@dataclass
class Entry:
    """One quantized weight: its logical name and shape, its rule, its stored parts."""

    name: str
    rule: Rule
    shape: tuple[int, ...]
    parts: dict[str, tuple[str, Meta]] = field(default_factory=dict)
    """role (q, scale, scale2, zero) -> (checkpoint name, its meta)"""

    @property
    def stored(self) -> str:
        return self.parts["q"][0]


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its shard index names, else all of them
    (every loader reads this list; this unit sits below them)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except json.JSONDecodeError as e:
            raise ConfigError(f"{index} is not valid JSON: {e}") from e
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in model directory {str(path)!r}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"shard(s) {missing} named by {index} do not exist")
    return files


class Checkpoint:
    """The tensors of one checkpoint directory, checked against its quantization scheme."""

    def __init__(self, path: Path):
        self.path = path
        self.scheme: Scheme | None = read_scheme(path)
        self.meta: dict[str, Meta] = {}
        for file in checkpoint_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    self.meta[name] = Meta(file, s.get_dtype(), tuple(s.get_shape()))
        self.entries: dict[str, Entry] = {}
        self.hidden: set[str] = set()
        self.noted: dict[str, int] = {}
        self._check()

    @property
    def label(self) -> str | None:
        """The weight format the checkpoint stores (None: unquantized)."""
        return None if self.scheme is None else self.scheme.label

    @property
    def stored_bytes(self) -> int:
        return sum(m.nbytes for m in self.meta.values())

    def view(self, file: Path) -> FileView:
        return FileView(self, Path(file))

    # -- checking -------------------------------------------------------------------------

    def _check(self) -> None:
        modules: dict[str, dict[str, str]] = {}
        for name in self.meta:
            module, _, part = name.rpartition(".")
            modules.setdefault(module, {})[part] = name
        for module, parts in modules.items():
            self._check_module(module, parts)
        if self.noted:
            log.info("checkpoint %s: activation / KV-cache scales not used (weight-only compute "
                     "in the model dtype): %s", self.path.name,
                     ", ".join(f"{k} x{v}" for k, v in sorted(self.noted.items())))

    def _check_module(self, module: str, parts: dict[str, str]) -> None:
        for p in NOTED:
            if p in parts:
                self.hidden.add(parts[p])
                self.noted[p] = self.noted.get(p, 0) + 1
        primary = parts.get("weight_packed") or parts.get("weight")
        meta = self.meta[primary] if primary else None
        low = meta is not None and meta.dtype in LOW
        extra = [parts[p] for p in WEIGHT_PARTS if p in parts and parts[p] != primary]
        if self.scheme is None:
            if low or extra:
                name = primary if low else extra[0]
                m = self.meta[name]
                raise ConfigError(
                    f"checkpoint tensor {name!r} is {m.dtype} {list(m.shape)}, a quantized "
                    f"weight's, but {self.path / 'config.json'} declares no quantization_config "
                    "(and there is no hf_quant_config.json): Baton never casts quantized bytes; "
                    "restore the producer's quantization config")
            return
        if not low:
            if extra:
                raise ConfigError(
                    f"checkpoint tensor {extra[0]!r} scales {primary or module + '.weight'!r}, "
                    f"which is stored {meta.dtype if meta else 'nowhere'}, not quantized: the "
                    "checkpoint is inconsistent")
            return
        rule = self.scheme.module(module)
        if rule is None:
            raise ConfigError(
                f"checkpoint tensor {primary!r} is {meta.dtype} {list(meta.shape)} but "
                f"{self.scheme.source} leaves module {module!r} unquantized (its exclusion list "
                "or per-layer map): the file and its config disagree")
        want = KIND_DTYPE[rule.kind]
        if meta.dtype != want:
            raise ConfigError(
                f"checkpoint tensor {primary!r} is {meta.dtype} {list(meta.shape)} but "
                f"{self.scheme.source} declares {rule.label} for module {module!r}, stored "
                f"as {want}")
        entry = Entry(module + ".weight", rule, meta.shape, {"q": (primary, meta)})
        getattr(self, f"_check_{rule.kind if not rule.kind.startswith('fp8') else 'fp8'}")(
            entry, parts)
        for name, _ in entry.parts.values():
            self.hidden.add(name)
        for p in extra:
            if p not in self.hidden:
                raise ConfigError(f"checkpoint tensor {p!r} is not part of {rule.label} "
                                  f"(module {module!r}): the checkpoint is inconsistent")
        self.entries[entry.name] = entry

    def _part(self, entry: Entry, parts: dict, role: str, suffix: str,
              shapes: list[tuple[int, ...]], dtypes=FLOAT) -> None:
        name = parts.get(suffix)
        q = entry.stored
        if name is None:
            raise ConfigError(
                f"checkpoint tensor {q!r} ({self.meta[q].dtype} {list(self.meta[q].shape)}, "
                f"{entry.rule.label}) has no {suffix!r}: a low-precision weight without its "
                "scale is refused, never cast")
        m = self.meta[name]
        if m.shape not in shapes:
            raise ConfigError(
                f"checkpoint tensor {name!r} has shape {list(m.shape)} but {q!r} "
                f"{list(self.meta[q].shape)} in {entry.rule.label} needs "
                f"{' or '.join(str(list(s)) for s in shapes)}")
        if m.dtype not in dtypes:
            raise ConfigError(f"checkpoint tensor {name!r} is {m.dtype}; {entry.rule.label} "
                              f"keeps it in {'/'.join(dtypes)}")
        entry.parts[role] = (name, m)

    def _check_fp8(self, entry: Entry, parts: dict) -> None:
        q = entry.shape
        r = entry.rule
        suffix = "weight_scale_inv" if self.scheme.method == "fp8" else "weight_scale"
        if r.kind == "fp8_block":
            if len(q) < 2:
                raise ConfigError(f"checkpoint tensor {entry.stored!r} {list(q)}: block scales "
                                  "need a 2-D weight")
            bn, bk = r.block
            grid = q[:-2] + (-(-q[-2] // bn), -(-q[-1] // bk))
            self._part(entry, parts, "scale", suffix, [grid])
        elif r.kind == "fp8_tensor":
            self._part(entry, parts, "scale", suffix, [(), (1,)])
        else:
            self._part(entry, parts, "scale", suffix, [q[:-1], q[:-1] + (1,)])

    def _check_nvfp4(self, entry: Entry, parts: dict, scale2: str = "weight_scale_2") -> None:
        """ModelOpt NVFP4 (`weight_scale_2`); compressed-tensors' (`_check_ct_nvfp4`) names its
        global scale `weight_global_scale`."""
        n, half = entry.shape[-2:]
        k = 2 * half
        if k % formats.NVFP4_GROUP:
            raise ConfigError(f"checkpoint tensor {entry.stored!r} {list(entry.shape)}: NVFP4 "
                              f"needs a width ({k}) that is a multiple of 16")
        entry.shape = entry.shape[:-1] + (k,)
        self._part(entry, parts, "scale", "weight_scale", [entry.shape[:-1] + (k // 16,)],
                   ("F8_E4M3",))
        self._part(entry, parts, "scale2", scale2, [(), (1,)])

    def _check_ct_nvfp4(self, entry: Entry, parts: dict) -> None:
        self._check_nvfp4(entry, parts, "weight_global_scale")

    def _check_int(self, entry: Entry, parts: dict) -> None:
        self._scales(entry, parts, entry.shape, zero_dtypes=("I8",) + FLOAT)

    def _check_packed(self, entry: Entry, parts: dict) -> None:
        r = entry.rule
        shape_name = parts.get("weight_shape")
        if shape_name is None:
            raise ConfigError(f"checkpoint tensor {entry.stored!r} (pack-quantized) has no "
                              "'weight_shape'")
        m = self.meta[shape_name]
        with safe_open(str(m.file), framework="pt", device="cpu") as f:
            logical = tuple(int(x) for x in f.get_tensor(shape_name).tolist())
        stored = self.meta[entry.stored].shape
        want = logical[:-1] + (-(-logical[-1] * r.bits // 32),)
        if stored != want:
            raise ConfigError(f"checkpoint tensor {entry.stored!r} has shape {list(stored)} but "
                              f"its weight_shape {list(logical)} packs {r.bits}-bit values "
                              f"into {list(want)}")
        entry.shape = logical
        self.hidden.add(shape_name)
        self._scales(entry, parts, logical, zero_dtypes=("I32",), packed_zero=True)

    def _scales(self, entry: Entry, parts: dict, shape: tuple[int, ...],
                zero_dtypes: tuple[str, ...], packed_zero: bool = False) -> None:
        r = entry.rule
        lead, k = shape[:-1], shape[-1]
        if r.strategy == "tensor":
            grids = [(), (1,)]
        elif r.strategy == "channel":
            grids = [lead + (1,)]
        else:
            grids = [lead + (-(-k // r.group),)]
        self._part(entry, parts, "scale", "weight_scale", grids)
        if r.symmetric:
            if "weight_zero_point" in parts:
                raise ConfigError(f"checkpoint tensor {parts['weight_zero_point']!r} is a zero "
                                  f"point but the scheme of {entry.stored!r} is symmetric")
            return
        zgrid = entry.parts["scale"][1].shape
        if packed_zero and r.strategy != "tensor":  # packed along the rows (dim -2)
            zgrid = zgrid[:-2] + (-(-zgrid[-2] * r.bits // 32), zgrid[-1])
        self._part(entry, parts, "zero", "weight_zero_point", [zgrid], zero_dtypes)


class FileView:
    """One safetensors file of a checkpoint as its logical tensors (see the module doc)."""

    def __init__(self, ckpt: Checkpoint, file: Path):
        self.ckpt, self.file = ckpt, file
        self._handles: dict[Path, object] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handles.clear()  # closes the mappings

    def _open(self, file: Path):
        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return h

    def keys(self) -> list[str]:
        c = self.ckpt
        out = []
        for name, m in c.meta.items():
            if m.file != self.file:
                continue
            if name not in c.hidden:
                out.append(name)
            elif name.endswith((".weight", ".weight_packed")):
                logical = name.rpartition(".")[0] + ".weight"
                if logical in c.entries and c.entries[logical].stored == name:
                    out.append(logical)
        return out

    def get_slice(self, name: str):
        entry = self.ckpt.entries.get(name)
        if entry is None:
            return self._open(self.ckpt.meta[name].file).get_slice(name)
        return QuantSlice(self, entry)

    def get_tensor(self, name: str) -> torch.Tensor:
        entry = self.ckpt.entries.get(name)
        if entry is None:
            return self._open(self.ckpt.meta[name].file).get_tensor(name)
        return QuantSlice(self, entry)[:]

    def packed(self, name: str, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> torch.Tensor | None:
        """Weight `name` (or its part [rows, cols]) packed as stored (`QuantSlice.packed`),
        None where it is not a quantized weight or has no packed form."""
        entry = self.ckpt.entries.get(name)
        return None if entry is None else QuantSlice(self, entry).packed(rows, cols)

    def raw(self, role_part: tuple[str, Meta]):
        name, meta = role_part
        return self._open(meta.file).get_slice(name)

    def full(self, role_part: tuple[str, Meta]) -> torch.Tensor:
        name, meta = role_part
        return self._open(meta.file).get_tensor(name)


class QuantSlice:
    """A quantized weight read by index like a safetensors slice; decodes to float32."""

    def __init__(self, view: FileView, entry: Entry):
        self.view, self.entry = view, entry

    def get_shape(self) -> list[int]:
        return list(self.entry.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, idx) -> torch.Tensor:
        shape = self.entry.shape
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(shape) != 2 or any(not isinstance(i, slice) or i.step not in (None, 1)
                                  for i in idx):
            return self._decode((0, shape[-2]), (0, shape[-1]), whole=True)[idx]
        spans = [i.indices(n)[:2] for i, n in zip(idx + (slice(None),) * (2 - len(idx)), shape,
                                                  strict=True)]
        return self._decode(*spans)

    def packed(self, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> torch.Tensor | None:
        """The weight, or its part [rows, cols] (a tensor-parallel shard: only that part of
        the stored bytes and scales is read, cut where `_decode` cuts), as the CPU kernels
        read it as stored (`packed`: fp8 with its scales per 128 columns, symmetric int8 per
        channel, symmetric int4 in groups of 32, NVFP4), or None where it has no packed form
        (other groups or tiles, zero points: decoded)."""
        from baton.model.quant import packed

        e, r, v = self.entry, self.entry.rule, self.view
        if len(e.shape) != 2:
            return None
        p, (n, k) = e.parts, e.shape
        (a, b), (c, d) = rows or (0, n), cols or (0, k)
        part = rows is not None or cols is not None
        if r.kind == "fp8_block" and r.block[1] == packed.FP8_GROUP:
            bn, bk = r.block
            if part:
                self._aligned((a, b), n, bn, "scale blocks", "rows")
                self._aligned((c, d), k, bk, "scale blocks", "columns")
            s = v.raw(p["scale"])[a // bn:-(-b // bn), c // bk:-(-d // bk)]
            s = s.to(torch.float32).repeat_interleave(bn, 0)[:b - a]
            return packed.pack_fp8(v.raw(p["q"])[a:b, c:d], s)
        if r.kind in ("fp8_tensor", "fp8_channel"):  # one scale a row: any cut, re-blocked
            s = v.full(p["scale"]).to(torch.float32)
            s = s.reshape(()) if s.numel() == 1 else s.reshape(n, 1)[a:b]
            return packed.pack_fp8(v.raw(p["q"])[a:b, c:d],
                                   s.expand(b - a, -(-(d - c) // packed.FP8_GROUP)))
        if r.kind == "nvfp4" and k % packed.NVFP4_GROUP == 0:
            s2 = v.full(p["scale2"])
            if s2.numel() != 1:
                return None
            g = packed.NVFP4_GROUP
            if part:
                self._aligned((c, d), k, g, "16-value scale groups", "columns")
            return packed.pack_nvfp4(v.raw(p["q"])[a:b, c // 2:d // 2],
                                     v.raw(p["scale"])[a:b, c // g:d // g], s2)
        if "zero" in p or not r.symmetric:
            return None
        s = v.full(p["scale"])
        if r.kind == "int" and r.bits == 8 and r.group is None and s.numel() == n:
            return packed.pack_int8(v.raw(p["q"])[a:b, c:d],
                                    s.to(torch.float32).reshape(n)[a:b])
        if (r.kind == "packed" and r.bits == 4 and r.group == packed.GROUP
                and k % packed.GROUP == 0 and tuple(s.shape) == (n, k // packed.GROUP)
                and s.dtype == torch.float16):
            if part:
                self._aligned((c, d), k, packed.GROUP, "scale groups", "columns")
            words = v.raw(p["q"])[a:b, c // 8:d // 8]
            q = formats.unpack_int32(words, 4, d - c)
            return packed.pack_int4(q, s[a:b, c // packed.GROUP:d // packed.GROUP])
        return None

    def _aligned(self, span: tuple[int, int], size: int, unit: int, what: str, axis: str):
        a, b = span
        if unit > 1 and (a % unit or (b % unit and b != size)):
            raise ConfigError(
                f"checkpoint tensor {self.entry.stored!r} {list(self.entry.shape)}: the part "
                f"[{a}:{b}] of its {axis} (a tensor-parallel shard or section) cuts its "
                f"{what} of {unit}; {self.entry.rule.label} splits only at multiples of "
                f"{unit}: use a tensor-parallel size whose shards are whole blocks, or 1")

    def _decode(self, rows: tuple[int, int], cols: tuple[int, int],
                whole: bool = False) -> torch.Tensor:
        e, r, v = self.entry, self.entry.rule, self.view
        p = e.parts
        n, k = e.shape[-2:]
        (a, b), (c, d) = rows, cols
        if whole:
            q = v.full(p["q"])
        if r.kind == "fp8_block":
            bn, bk = r.block
            if not whole:
                self._aligned(rows, n, bn, "scale blocks", "rows")
                self._aligned(cols, k, bk, "scale blocks", "columns")
                q = v.raw(p["q"])[a:b, c:d]
            s = v.full(p["scale"]) if whole else \
                v.raw(p["scale"])[a // bn:-(-b // bn), c // bk:-(-d // bk)]
            return formats.fp8_block(q, s, r.block)
        if r.kind in ("fp8_tensor", "fp8_channel"):
            s = v.full(p["scale"])
            if not whole:
                q = v.raw(p["q"])[a:b, c:d]
                s = s if s.numel() == 1 else s[a:b]
            return formats.fp8_scaled(q, s)
        if r.kind in ("nvfp4", "ct_nvfp4"):
            g = formats.NVFP4_GROUP
            if whole:
                s = v.full(p["scale"])
            else:
                self._aligned(cols, k, g, "16-value scale groups", "columns")
                q = v.raw(p["q"])[a:b, c // 2:d // 2]
                s = v.raw(p["scale"])[a:b, c // g:d // g]
            decode = formats.nvfp4 if r.kind == "nvfp4" else formats.nvfp4_ct
            return decode(q, s, v.full(p["scale2"]))
        # int / packed
        g = r.group
        per_word = 32 // r.bits if r.kind == "packed" else 1
        if not whole:
            self._aligned(cols, k, g or 1, "scale groups", "columns")
            self._aligned(cols, k, per_word, f"{per_word}-value int32 words", "columns")
        if r.kind == "packed":
            words = v.full(p["q"]) if whole else \
                v.raw(p["q"])[a:b, c // per_word:-(-d // per_word)]
            q = formats.unpack_int32(words, r.bits, (k if whole else d - c))
        elif not whole:
            q = v.raw(p["q"])[a:b, c:d]
        s = v.full(p["scale"])
        z = None
        if "zero" in p:
            z = v.full(p["zero"])
            if r.kind == "packed" and r.strategy != "tensor":
                rows_n = s.shape[-2]
                z = formats.unpack_int32(z.transpose(-1, -2), r.bits, rows_n).transpose(-1, -2)
        if not whole and r.strategy != "tensor":
            gs = slice(c // g, -(-d // g)) if g else slice(None)
            s = s[a:b, gs]
            z = None if z is None else z[a:b, gs]
        return formats.int_grouped(q, s, z, g)
