"""What a checkpoint's quantization config says, and how each of its modules' weights is stored.

`read_scheme(dir)` reads `config.json`'s `quantization_config` (top level, or under
`text_config`) or ModelOpt's `hf_quant_config.json`:

    quant_method fp8                 Qwen fine-grained FP8: `weight_scale_inv` per
                                     `weight_block_size` tile (None: one per tensor)
    quant_method modelopt /          `quant_algo` FP8 (per tensor), FP8_PER_CHANNEL_PER_TOKEN,
    hf_quant_config.json             NVFP4 / W4A16_NVFP4, MIXED_PRECISION with its
                                     `quantized_layers` map; `exclude_modules` / `ignore`
    quant_method compressed-tensors  `config_groups` (targets, weights args), `ignore`, `format`
                                     float-quantized, int-quantized, naive-quantized,
                                     pack-quantized (mixed-precision: per group)

Anything else is refused, naming the method and those Baton reads. `Scheme.module(name)`
answers how one module (`...mlp.up_proj`) is declared: a `Rule`, or None (left unquantized).
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

from baton.errors import ConfigError

METHODS = ("fp8", "modelopt", "compressed-tensors")
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "NVFP4", "W4A16_NVFP4", "MIXED_PRECISION")
CT_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized",
              "nvfp4-pack-quantized", "mixed-precision")


@dataclass(frozen=True)
class Rule:
    """How one module's weight is stored."""

    kind: str
    """fp8_block | fp8_tensor | fp8_channel | nvfp4 (ModelOpt) | ct_nvfp4 (compressed-tensors
    NVFP4) | int (int8 weights) | packed (int32-packed)"""
    block: tuple[int, int] | None = None
    group: int | None = None
    """Columns sharing one scale (int / packed with strategy group), None: one per row."""
    bits: int = 8
    symmetric: bool = True
    label: str = ""
    strategy: str = ""
    """compressed-tensors int weights: tensor | channel | group."""


@dataclass(frozen=True)
class Scheme:
    method: str
    algo: str
    """The declared algorithm (ModelOpt quant_algo, the CT format, fp8's fmt)."""
    source: str
    """Where it was read (for messages)."""
    raw: dict

    def module(self, name: str) -> Rule | None:
        """How module `name` (checkpoint name, no `.weight`) is declared; None: unquantized."""
        if _excluded(name, self.ignore):
            return None
        if self.method == "fp8":
            return self._fp8_rule()
        if self.method == "modelopt":
            algo = self.algo
            if algo == "MIXED_PRECISION":
                algo = _mixed_algo(name, self.raw.get("quantized_layers") or {})
                if algo is None:
                    return None
            return _modelopt_rule(algo, self.raw.get("group_size", 16), self.source)
        return _ct_rule(name, self.raw, self.source)

    @property
    def ignore(self) -> list[str]:
        r = self.raw
        if self.method == "fp8":
            return list(r.get("modules_to_not_convert") or r.get("ignored_layers") or [])
        if self.method == "modelopt":
            return list(r.get("exclude_modules") or r.get("ignore") or [])
        return list(r.get("ignore") or [])

    @property
    def label(self) -> str:
        """The weight format, short (the engine-ready line, /v1/models, metrics, handshake)."""
        if self.method == "fp8":
            b = self.raw.get("weight_block_size")
            return f"fp8_block{b[0]}x{b[1]}" if b else "fp8_tensor"
        if self.method == "modelopt":
            return {"FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8_channel", "NVFP4": "nvfp4",
                    "W4A16_NVFP4": "nvfp4", "MIXED_PRECISION": "mixed_fp8_nvfp4"}[self.algo]
        labels = sorted({_ct_args_rule(g.get("weights") or {}, g.get("format") or self.algo,
                                       self.source, k).label
                         for k, g in (self.raw.get("config_groups") or {}).items()})
        return "+".join(labels) or "compressed_tensors"

    def _fp8_rule(self) -> Rule:
        b = self.raw.get("weight_block_size")
        if b is None:
            return Rule("fp8_tensor", label="fp8_tensor")
        return Rule("fp8_block", block=(int(b[0]), int(b[1])), label=f"fp8_block{b[0]}x{b[1]}")


def read_scheme(path: str | Path) -> Scheme | None:
    """The checkpoint's quantization scheme, None when it declares none; refused (ConfigError,
    one line) when it declares one Baton does not read."""
    path = Path(path)
    # a folder of bare weights (no config.json: a loader's piece read on its own) declares
    # nothing; low-precision tensors in it are still refused by the checkpoint's check
    cfg = _json(path / "config.json") if (path / "config.json").is_file() else {}
    qc = cfg.get("quantization_config")
    if qc is None and isinstance(cfg.get("text_config"), dict):
        qc = cfg["text_config"].get("quantization_config")
    hq = path / "hf_quant_config.json"
    if qc is None and hq.is_file():
        h = _json(hq)
        q = h.get("quantization")
        if not isinstance(q, dict):
            raise ConfigError(f"{hq} has no 'quantization' object; ModelOpt writes "
                              "{\"producer\": ..., \"quantization\": {\"quant_algo\": ...}}")
        return _modelopt(dict(q), str(hq))
    if qc is None:
        return None
    src = f"{path / 'config.json'} quantization_config"
    if not isinstance(qc, dict):
        raise ConfigError(f"{src} must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fine_grained_fp8(qc, src)
    if method == "modelopt":
        return _modelopt(qc, src)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, src)
    raise ConfigError(f"{src}: quant_method {method!r} is not read by Baton (it reads "
                      f"{list(METHODS)}); use a checkpoint in one of those formats or in "
                      "bf16/fp32")


def _json(p: Path) -> dict:
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{p} must hold a JSON object")
    return d


def _fine_grained_fp8(qc: dict, src: str) -> Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{src}: fmt {fmt!r} is not read by Baton (it reads 'e4m3')")
    b = qc.get("weight_block_size")
    if b is not None and (not isinstance(b, list) or len(b) != 2
                          or not all(isinstance(x, int) and x > 0 for x in b)):
        raise ConfigError(f"{src}: weight_block_size {b!r} must be two positive integers, "
                          "e.g. [128, 128]")
    return Scheme("fp8", "fp8", src, qc)


def _modelopt(q: dict, src: str) -> Scheme:
    algo = q.get("quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise ConfigError(f"{src}: ModelOpt quant_algo {algo!r} is not read by Baton (it reads "
                          f"{list(MODELOPT_ALGOS)})")
    if algo == "MIXED_PRECISION" and not isinstance(q.get("quantized_layers"), dict):
        raise ConfigError(f"{src}: quant_algo MIXED_PRECISION needs its 'quantized_layers' map")
    for name, v in (q.get("quantized_layers") or {}).items():
        a = v.get("quant_algo") if isinstance(v, dict) else None
        if a not in MODELOPT_ALGOS[:-1]:
            raise ConfigError(f"{src}: quantized_layers[{name!r}] quant_algo {a!r} is not read "
                              f"by Baton (it reads {list(MODELOPT_ALGOS[:-1])})")
    g = q.get("group_size", 16)
    if algo in ("NVFP4", "W4A16_NVFP4", "MIXED_PRECISION") and g not in (16, None):
        raise ConfigError(f"{src}: NVFP4 group_size {g!r}: the format has 16 values a scale")
    return Scheme("modelopt", algo, src, {**q, "group_size": 16})


def _compressed_tensors(qc: dict, src: str) -> Scheme:
    fmt = qc.get("format")
    if fmt not in CT_FORMATS:
        raise ConfigError(f"{src}: compressed-tensors format {fmt!r} is not read by Baton (it "
                          f"reads {list(CT_FORMATS)})")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{src}: compressed-tensors needs 'config_groups'")
    for k, g in groups.items():
        _ct_args_rule(g.get("weights") or {}, g.get("format") or fmt, src, k)  # validates
    return Scheme("compressed-tensors", fmt, src, qc)


def _modelopt_rule(algo: str, group: int, src: str) -> Rule:
    if algo == "FP8":
        return Rule("fp8_tensor", label="fp8")
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return Rule("fp8_channel", label="fp8_channel")
    return Rule("nvfp4", group=16, bits=4, label="nvfp4")


def _mixed_algo(name: str, layers: dict) -> str | None:
    for pattern, v in layers.items():
        if any(_match(n, pattern) for n in _names(name)):
            return v["quant_algo"]
    return None


def _ct_rule(name: str, qc: dict, src: str) -> Rule | None:
    for key, g in qc["config_groups"].items():
        if any(t == "Linear" or _match(n, t) for t in g.get("targets") or []
               for n in _names(name)):
            if not g.get("weights"):
                return None
            return _ct_args_rule(g["weights"], g.get("format") or qc["format"], src, key)
    return None


def _ct_args_rule(w: dict, fmt: str, src: str, key: str) -> Rule:
    where = f"{src}: config_groups[{key!r}].weights"
    bits, typ = w.get("num_bits"), w.get("type")
    strategy, sym = w.get("strategy"), w.get("symmetric", True)
    if w.get("actorder") not in (None, False, "static", "weight"):
        raise ConfigError(f"{where}: actorder {w.get('actorder')!r} (a g_idx permutation) is "
                          "not read by Baton; requantize without activation ordering")
    if typ == "float" and bits == 4:  # NVFP4: e2m1 x (e4m3 per 16 / a global scale)
        if fmt != "nvfp4-pack-quantized" or w.get("group_size") != 16 or not sym \
                or strategy not in ("tensor_group", "group"):
            raise ConfigError(
                f"{where}: float 4-bit weights (format {fmt!r}, strategy {strategy!r}, "
                f"group_size {w.get('group_size')!r}, symmetric {sym!r}): Baton reads NVFP4 "
                "as nvfp4-pack-quantized, tensor_group, group_size 16, symmetric")
        return Rule("ct_nvfp4", group=16, bits=4, label="nvfp4_ct", strategy="tensor_group")
    if typ == "float":
        if bits != 8:
            raise ConfigError(f"{where}: float num_bits {bits!r}: Baton reads 8 (fp8 e4m3) "
                              "and 4 (NVFP4)")
        if strategy == "tensor":
            return Rule("fp8_tensor", label="fp8_tensor")
        if strategy == "channel":
            return Rule("fp8_channel", label="fp8_channel")
        if strategy == "block":
            b = w.get("block_structure") or [128, 128]
            return Rule("fp8_block", block=(int(b[0]), int(b[1])),
                        label=f"fp8_block{b[0]}x{b[1]}")
        raise ConfigError(f"{where}: fp8 strategy {strategy!r}: Baton reads tensor, channel, "
                          "block")
    if typ != "int" or bits not in (4, 8) or (bits == 4 and fmt != "pack-quantized"):
        raise ConfigError(f"{where}: {typ!r} {bits!r}-bit weights in format {fmt!r}: Baton "
                          "reads fp8 (float-quantized), int8 (int-/pack-quantized) and int4 "
                          "(pack-quantized)")
    if strategy not in ("channel", "group", "tensor"):
        raise ConfigError(f"{where}: int strategy {strategy!r}: Baton reads channel, group, "
                          "tensor")
    group = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(group, int) and group > 0):
        raise ConfigError(f"{where}: group strategy needs a positive group_size, got {group!r}")
    kind = "packed" if fmt == "pack-quantized" else "int"
    label = f"w{bits}a16" + (f"_g{group}" if group else f"_{strategy}") + ("" if sym else "_asym")
    return Rule(kind, group=group, bits=bits, symmetric=bool(sym), label=label,
                strategy=strategy)


PREFIXES = (("backbone.", "model."), ("model.language_model.", "model."))
"""Checkpoint name prefixes a producer's lists may use for one another (NemotronH on disk
`backbone.`, transformers' `model.`; Qwen3.5's multimodal `model.language_model.`): vllm#28072."""


def _names(name: str) -> list[str]:
    """`name` and its spellings under the other prefixes of `PREFIXES`."""
    out = [name]
    for a, b in PREFIXES:
        for x, y in ((a, b), (b, a)):
            if name.startswith(x):
                out.append(y + name[len(x):])
    return out


def _excluded(name: str, patterns: list[str]) -> bool:
    return any(_match(n, p) for n in _names(name) for p in patterns)


def _match(name: str, pattern: str) -> bool:
    """An exclusion / target entry covers module `name`: equal, a parent of it, a trailing part
    of its name (`lm_head`, `mlp.gate`), a glob (ModelOpt `*self_attn*`), or `re:` (compressed-
    tensors, matched from the start)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".") or name.endswith("." + pattern)
