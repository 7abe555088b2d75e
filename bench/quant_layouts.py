"""Seeded checkpoints in the published quantized layouts, written from a float checkpoint, and
an independent dequantizer that turns one back into a float32 checkpoint (the oracle's input).

Written from the formats' descriptions (/work/shared/QUANTIZATION.md), sharing no code with
`baton.model.quant`: tiles by padding and reshaping, nibbles by strided assignment.

    qwen_fp8         quant_method fp8, weight_block_size [128, 128], weight_scale_inv (its
                     dtype given), modules_to_not_convert as Qwen publishes
    modelopt_fp8     hf_quant_config.json FP8: weight_scale per tensor, input_scale
    modelopt_nvfp4   NVFP4: uint8 pairs (low nibble first), e4m3 scale per 16, weight_scale_2
    modelopt_mixed   MIXED_PRECISION: routed experts NVFP4, the rest FP8, the map per layer
    ct_fp8           compressed-tensors float-quantized, fp8 per output channel
    ct_w4a16         compressed-tensors pack-quantized int4, group 16 (asym: zero points)
    ct_nvfp4         compressed-tensors nvfp4-pack-quantized: ModelOpt's bytes and e4m3
                     scales, `weight_global_scale` = 6 * 448 / amax (w = e2m1 * (s / g))
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0
GROUP = 16
"""The int4 group (compressed-tensors' own decompression needs it to divide every width)."""
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

LAYOUTS = ("qwen_fp8", "modelopt_fp8", "modelopt_nvfp4", "modelopt_mixed", "ct_fp8",
           "ct_w4a16", "ct_w4a16_asym", "ct_nvfp4")

# What each family's published checkpoints leave unquantized (QUANTIZATION.md 1a-1c)
QWEN_KEEP = re.compile(r"(embed_tokens|lm_head|norm|conv1d|in_proj_a|in_proj_b|mlp\.gate\.|"
                       r"shared_expert_gate|visual)")
NEMOTRON_KEEP = re.compile(r"(embeddings|lm_head|norm|conv1d|mixer\.gate\.|mixer\.[qkvo]_proj)")
NEMOTRON_MAMBA_KEPT = "layers.0.mixer."
"""As Nano keeps the Mamba layers that feed attention: layer 0's in/out_proj stay bf16."""


def read(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = json.loads((src / "config.json").read_text())
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        return cfg, {k: f.get_tensor(k) for k in f.keys()}


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from baton.model.qwen3_5.moe_make import per_expert as split

    return split(tensors)


def quantized(family: str, name: str, t: torch.Tensor) -> bool:
    if not name.endswith(".weight") or t.dim() != 2:
        return False
    if family == "nemotron_h":
        return not NEMOTRON_KEEP.search(name) and NEMOTRON_MAMBA_KEPT not in name
    return not QWEN_KEEP.search(name)


def write(src: Path, out: Path, layout: str, *, scale_dtype=torch.bfloat16,
          block=(128, 128)) -> Path:
    """`src` (a float checkpoint, per-expert tensors) in `layout` at `out`."""
    cfg, tensors = read(src)
    tensors = per_expert(tensors)  # the quantized releases store one tensor per expert
    family = "nemotron_h" if cfg.get("model_type") == "nemotron_h" else "qwen"
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    state: dict[str, torch.Tensor] = {}
    kept, layers = [], {}
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if not quantized(family, name, t):
            if name.endswith(".weight") and t.dim() == 2:
                kept.append(module)
            state[name] = t
            continue
        algo = "FP8" if layout == "modelopt_fp8" else "NVFP4"
        if layout == "modelopt_mixed":
            algo = "NVFP4" if re.search(r"experts\.\d+\.", name) else "FP8"
        layers[module] = {"quant_algo": algo}
        if layout == "qwen_fp8":
            q, s = fp8_block(t, block, scale_dtype)
            state |= {name: q, module + ".weight_scale_inv": s}
        elif layout.startswith("modelopt"):
            state[module + ".input_scale"] = torch.tensor(0.02)
            if algo == "FP8":
                q, s = fp8_tensor(t)
                state |= {name: q, module + ".weight_scale": s}
            else:
                q, s, s2 = nvfp4(t)
                state |= {name: q, module + ".weight_scale": s, module + ".weight_scale_2": s2}
        elif layout == "ct_fp8":
            q, s = fp8_channel(t, scale_dtype)
            state |= {name: q, module + ".weight_scale": s}
        elif layout == "ct_nvfp4":
            state.pop(name, None)
            state |= {f"{module}.{k}": v for k, v in ct_nvfp4(t).items()}
        else:
            state.pop(name, None)
            state |= {f"{module}.{k}": v
                      for k, v in int4_packed(t, GROUP, layout.endswith("asym"), scale_dtype).items()}
    cfg = dict(cfg)
    if layout == "qwen_fp8":
        cfg["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": ["lm_head", "mlp.gate", "shared_expert_gate",
                                       "linear_attn.in_proj_a", "linear_attn.in_proj_b"]}
    elif layout.startswith("modelopt"):
        algo = {"modelopt_fp8": "FP8", "modelopt_nvfp4": "NVFP4"}.get(layout, "MIXED_PRECISION")
        q = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
             "exclude_modules": sorted(kept)}
        if algo == "MIXED_PRECISION":
            q["quantized_layers"] = layers
        (out / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": q}, indent=1))
    else:
        cfg["quantization_config"] = ct_config(layout, kept)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def ct_config(layout: str, kept: list[str]) -> dict:
    if layout == "ct_fp8":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                   "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                "dynamic": True}
        fmt = "float-quantized"
    elif layout == "ct_nvfp4":
        weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                   "group_size": 16, "symmetric": True, "dynamic": False}
        acts, fmt = None, "nvfp4-pack-quantized"
    else:
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP,
                   "symmetric": not layout.endswith("asym"), "dynamic": False}
        acts, fmt = None, "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": sorted(kept),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}}}


# -- encoders ----------------------------------------------------------------------------

def _tiles(t: torch.Tensor, block) -> torch.Tensor:
    """[N, K] zero-padded to whole tiles, as [N/bn, bn, K/bk, bk]."""
    n, k = t.shape
    bn, bk = block
    p = torch.nn.functional.pad(t, (0, -k % bk, 0, -n % bn))
    return p.reshape(p.shape[0] // bn, bn, p.shape[1] // bk, bk)


def fp8_block(t, block, scale_dtype):
    tiles = _tiles(t.float(), block)
    s = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
    q = (tiles / s.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(tiles.shape[0] * block[0], -1)[: t.shape[0], : t.shape[1]]
    return q.to(torch.float8_e4m3fn).contiguous(), s


def fp8_tensor(t):
    s = (t.float().abs().max() / FP8_MAX).reshape(())
    return (t.float() / s).to(torch.float8_e4m3fn), s


def fp8_channel(t, scale_dtype):
    s = (t.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).to(scale_dtype)
    return (t.float() / s.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def nvfp4(t):
    n, k = t.shape
    w = t.float()
    s2 = (w.abs().max() / (6 * FP8_MAX)).reshape(())
    g = w.reshape(n, k // 16, 16)
    s = (g.abs().amax(-1) / (6 * s2)).to(torch.float8_e4m3fn)
    x = g / (s.float()[..., None] * s2).clamp(min=1e-30)
    mag = (x.abs()[..., None] - E2M1).abs().argmin(-1)
    code = (mag | ((x < 0).long() << 3)).reshape(n, k)
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    packed[:] = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed, s, s2.float()


def ct_nvfp4(t):
    """compressed-tensors' NVFP4: the global scale divides (g = 6 * 448 / amax), so the e4m3
    group scale is amax(group) * g / 6."""
    n, k = t.shape
    w = t.float()
    gs = (6 * FP8_MAX / w.abs().max().clamp(min=1e-12)).reshape(1)
    g = w.reshape(n, k // 16, 16)
    s = (g.abs().amax(-1) * gs / 6).to(torch.float8_e4m3fn)
    x = g / (s.float()[..., None] / gs).clamp(min=1e-30)
    mag = (x.abs()[..., None] - E2M1).abs().argmin(-1)
    code = (mag | ((x < 0).long() << 3)).reshape(n, k)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return {"weight_packed": packed, "weight_scale": s, "weight_global_scale": gs.float(),
            "input_global_scale": torch.ones(1)}


def int4_packed(t, group, asym, scale_dtype):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    n, k = t.shape
    g = torch.nn.functional.pad(t.float(), (0, -k % group)).reshape(n, -1, group)
    if asym:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype)
        zp = (-8 - torch.round(lo / s.float())).clamp(-8, 7)
    else:
        s = (g.abs().amax(-1) / 7.5).clamp(min=1e-8).to(scale_dtype)
        zp = torch.zeros_like(s, dtype=torch.float32)
    q = (torch.round(g / s.float()[..., None]) + zp[..., None]).clamp(-8, 7)
    q = q.reshape(n, -1)[:, :k].to(torch.int8)
    out = {"weight_packed": pack_to_int32(q, 4), "weight_scale": s,
           "weight_shape": torch.tensor([n, k])}
    if asym:
        out["weight_zero_point"] = pack_to_int32(zp.to(torch.int8), 4, packed_dim=0)
    return out


# -- the independent dequantizer ---------------------------------------------------------

def dequantized_copy(qdir: Path, out: Path) -> Path:
    """A float32 checkpoint of what quantized checkpoint `qdir` encodes, without its
    quantization config: transformers runs it as the reference."""
    cfg = json.loads((qdir / "config.json").read_text())
    qc = cfg.pop("quantization_config", None)
    with safe_open(str(qdir / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    state = {}
    for name, v in t.items():
        module, _, part = name.rpartition(".")
        if part in ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale",
                    "weight_zero_point", "weight_shape", "weight_global_scale",
                    "input_global_scale"):
            continue
        if qc and qc.get("format") == "nvfp4-pack-quantized" and part == "weight_packed":
            # the format's definition, in float32 (the package decompresses in bfloat16)
            n, half = v.shape
            lut = torch.cat([E2M1, -E2M1])
            codes = torch.empty(n, 2 * half, dtype=torch.long)
            codes[:, 0::2] = (v & 15).long()
            codes[:, 1::2] = (v >> 4).long()
            s = t[module + ".weight_scale"].float() / t[module + ".weight_global_scale"].float()
            state[module + ".weight"] = (lut[codes].reshape(n, -1, 16) * s[..., None]
                                         ).reshape(n, -1)
        elif qc and qc.get("quant_method") == "compressed-tensors" and (
                part == "weight_packed" or (part == "weight" and v.dtype in (torch.float8_e4m3fn, torch.int8))):
            state[module + ".weight"] = _ct_decompress(t, module, qc)
        elif v.dtype == torch.float8_e4m3fn:
            s = t.get(module + ".weight_scale_inv", t.get(module + ".weight_scale")).float()
            if module + ".weight_scale_inv" in t:
                bn, bk = qc["weight_block_size"]
                tiles = _tiles(v.float(), (bn, bk)) * s[:, None, :, None]
                w = tiles.reshape(tiles.shape[0] * bn, -1)[: v.shape[0], : v.shape[1]]
            else:
                w = v.float() * (s if s.dim() == 0 else s.reshape(-1, 1))
            state[name] = w.contiguous()
        elif v.dtype == torch.uint8:
            n, half = v.shape
            lut = torch.cat([E2M1, -E2M1])
            codes = torch.empty(n, 2 * half, dtype=torch.long)
            codes[:, 0::2] = (v & 15).long()
            codes[:, 1::2] = (v >> 4).long()
            g = lut[codes].reshape(n, -1, 16) * t[module + ".weight_scale"].float()[..., None]
            state[name] = (g * t[module + ".weight_scale_2"].float()).reshape(n, -1)
        else:
            state[name] = v.float() if v.is_floating_point() else v
    out.mkdir(parents=True, exist_ok=True)
    for f in qdir.iterdir():
        if f.suffix == ".json" and f.name not in ("config.json", "hf_quant_config.json"):
            shutil.copy(f, out / f.name)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def _ct_decompress(t, module, qc):
    """compressed-tensors' own decompression of one module (the package's compressor for the
    checkpoint's format, run on the module's tensors; scales widened to float32 first so it
    multiplies in float32, as the exact reference does)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    g = qc["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=g["targets"], weights=g["weights"])
    sd = {k.rpartition(".")[2]: v for k, v in t.items() if k.rpartition(".")[0] == module}
    sd["weight_scale"] = sd["weight_scale"].float()
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    return compressor.decompress(sd, scheme)["weight"].float()
