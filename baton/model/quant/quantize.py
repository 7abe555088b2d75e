"""int8 / int4 weights from a float checkpoint: `model.quantize` at load and `baton quantize IN
OUT` (a compressed-tensors checkpoint that Baton and transformers, through the
`compressed-tensors` package, load).

    int8   per output channel, symmetric: s = amax(row) / 127 (float32), q = round(w / s)
           in [-127, 127]; compressed-tensors `int-quantized`, strategy channel
    int8g  groups of 32 columns (llama.cpp's Q8_0 blocks; the last one partial where K % 32),
           symmetric: s = amax(group) / 127 rounded to float16, q = round(w / s) in
           [-127, 127] (packed in memory for the integer path and the int8 embeddings;
           compressed-tensors `int-quantized`, strategy group, group_size 32)
    int4   groups of 32 columns, symmetric: s = amax(group) / 7 rounded to float16,
           q = round(w / s) in [-8, 7]; `pack-quantized` (8 values an int32), strategy group

What is quantized: every projection (attention q/k/v/o, Mamba in/out_proj, DeltaNet
in_proj_qkv / in_proj_z / out_proj, MLP and expert up/gate/down). What stays in the model's
dtype, as llama.cpp and ModelOpt keep it: norms, the MoE router and shared-expert gate, conv1d,
A_log / D / dt_bias, DeltaNet's in_proj_a / in_proj_b (per-head gates), latent MoE projections,
the MTP head, and the embeddings and LM head (the most sensitive tensors, and a tied head reads
the embeddings: both stay exact). int4 also keeps a projection whose width is not a multiple
of 32 (transformers' compressed-tensors path cannot decode a partial group); the log counts
the tensors kept.

At load (`model.quantize`) the loader packs each weight as it is read (`packed.pack`: the
values a written checkpoint decodes to, bit for bit), and the CPU kernels read them as stored.
`quantize_model` quantizes a loaded model in place and dequantizes back into its dtype (the
same numerics in float memory: a reference).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch

from baton.errors import ConfigError
from baton.model.quant import formats
from baton.model.quant.served import QUANTIZE_GROUP

log = logging.getLogger("baton.model")

MODES = ("int8", "int4")
GROUP = QUANTIZE_GROUP
KEEP = re.compile(r"(embed|embeddings|lm_head|norm|conv1d|\.gate\.|\.gate$|shared_expert_gate|"
                  r"in_proj_a\b|in_proj_b\b|in_proj_ba\b|latent|^mtp\.|\.mtp\.|A_log|dt_bias|\.D$)")
FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|up_proj|down_proj)$")


def quantizable(name: str, t: torch.Tensor, mode: str = "int8") -> bool:
    """Does `mode` quantize tensor `name` (checkpoint or model naming)? int4 needs a width
    that is a whole number of groups (compressed-tensors' own decompression does)."""
    if t.dim() < 2 or not t.is_floating_point() or KEEP.search(name):
        return False
    if mode == "int4" and t.shape[-1] % GROUP:
        return False
    return name.endswith(".weight") or FUSED_EXPERTS.search(name) is not None


def encode(w: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """`w` [..., N, K] as compressed-tensors tensors (`weight` / `weight_packed`,
    `weight_scale`, `weight_shape`)."""
    x = w.to(torch.float32)
    if mode == "int8":
        s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(x / s).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "weight_scale": s}
    if mode == "int8g":
        k = x.shape[-1]
        g = torch.nn.functional.pad(x, (0, -k % GROUP)).unflatten(-1, (-1, GROUP))
        s32 = g.abs().amax(-1) / 127
        if not bool(torch.isfinite(s32).all()) or bool((s32 > 65504).any()):
            raise ValueError(f"int8 per {GROUP} columns: a weight of magnitude "
                             f"{float(g.abs().max()):.3g} (float16 scales reach 65504 x 127)")
        s = s32.to(torch.float16)
        s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero group: any scale is exact
        q = torch.round(g / s.to(torch.float32)[..., None]).clamp(-127, 127).flatten(-2)[..., :k]
        return {"weight": q.to(torch.int8), "weight_scale": s}
    k = x.shape[-1]
    g = torch.nn.functional.pad(x, (0, -k % GROUP)).unflatten(-1, (-1, GROUP))
    s = (g.abs().amax(-1) / 7).to(torch.float16)
    s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero group: any scale is exact
    q = torch.round(g / s.to(torch.float32)[..., None]).clamp(-8, 7).flatten(-2)[..., :k]
    return {"weight_packed": pack_int32(q.to(torch.int64), 4), "weight_scale": s,
            "weight_shape": torch.tensor(list(w.shape[-2:]))}


def decode(parts: dict[str, torch.Tensor], mode: str) -> torch.Tensor:
    """What Baton's loader decodes `encode`'s tensors to (float32)."""
    if mode == "int8":
        return formats.int_grouped(parts["weight"], parts["weight_scale"], None, None)
    if mode == "int8g":
        return formats.int_grouped(parts["weight"], parts["weight_scale"], None, GROUP)
    k = int(parts["weight_shape"][-1])
    q = formats.unpack_int32(parts["weight_packed"], 4, k)
    return formats.int_grouped(q, parts["weight_scale"], None, GROUP)


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed `bits`-bit values [..., K] packed 32/bits an int32 word (value + 2^(b-1); element
    i of a word in bits [b*i, b*i+b)), the last word zero-padded."""
    per = 32 // bits
    u = q + (1 << (bits - 1))
    u = torch.nn.functional.pad(u, (0, -u.shape[-1] % per)).unflatten(-1, (-1, per))
    words = (u << (torch.arange(per, device=q.device) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_model(model, mode: str) -> int:
    """Every quantizable weight replaced, in place, by its int8 / int4 values dequantized (what
    the written checkpoint decodes to; `model.quantize` packs at load instead). Returns the
    count."""
    if mode not in MODES:
        raise ConfigError(f"model.quantize {mode!r}: choose one of {list(MODES)} (or leave it "
                          "unset)")
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if quantizable(name, p, mode):
                p.copy_(decode(encode(p, mode), mode).to(p.dtype))
                n += 1
    log.info("%s: %d weight tensors quantized in place (dequantized into the model dtype: "
             "int8/int4 numerics, float memory)", mode, n)
    return n


def ct_config(mode: str, kept: list[str]) -> dict:
    if mode == "int8":
        weights = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True,
                   "dynamic": False}
        fmt = "int-quantized"
    else:
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP,
                   "symmetric": True, "dynamic": False}
        fmt = "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": sorted(kept),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "format": fmt}}}


def write_quantized(src: str | Path, out: str | Path, mode: str) -> Path:
    """`baton quantize SRC OUT --to MODE`: SRC (a float checkpoint) as a compressed-tensors
    checkpoint at OUT, one output file per input file; fused expert tensors are written one per
    expert (as compressed-tensors quantizes Linear modules). Refuses a quantized SRC and an
    OUT that exists."""
    from safetensors.torch import save_file

    from baton.model.quant import open_checkpoint

    src, out = Path(src), Path(out)
    if mode not in MODES:
        raise ConfigError(f"baton quantize --to {mode!r}: choose one of {list(MODES)}")
    ckpt = open_checkpoint(src)
    if ckpt.label is not None:
        raise ConfigError(f"{src} is already quantized ({ckpt.label}): quantize its float "
                          "(bf16 / fp32) release instead")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"output folder {str(out)!r} exists and is not empty: name a new one")
    out.mkdir(parents=True, exist_ok=True)
    files = sorted({m.file for m in ckpt.meta.values()})
    weight_map, kept, n = {}, [], 0
    for file in files:
        state = {}
        with ckpt.view(file) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                for k, v in _per_expert(name, t):
                    if not quantizable(k, v, mode):
                        if k.endswith(".weight") and v.dim() == 2:
                            kept.append(k[: -len(".weight")])
                        state[k] = v.contiguous()
                        continue
                    module = k[: -len(".weight")]
                    state.update({f"{module}.{p}": x.contiguous()
                                  for p, x in encode(v, mode).items()})
                    n += 1
        save_file(state, str(out / file.name), metadata={"format": "pt"})
        weight_map.update({k: file.name for k in state})
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(p, out / p.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = ct_config(mode, kept)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    log.info("wrote %s: %d tensors quantized to %s, %d modules kept", out, n, mode, len(kept))
    return out


def _per_expert(name: str, t: torch.Tensor):
    """Fused experts [E, out, in] as one `{pre}.{e}.{proj}.weight` each (gate_up_proj: its
    gate and up halves); any other tensor as it is."""
    m = FUSED_EXPERTS.search(name)
    if m is None or t.dim() != 3:
        yield name, t
        return
    pre = name[: m.start()] + ".experts"
    for e in range(t.shape[0]):
        if m[1] == "gate_up_proj":
            gate, up = t[e].chunk(2)
            yield f"{pre}.{e}.gate_proj.weight", gate
            yield f"{pre}.{e}.up_proj.weight", up
        else:
            yield f"{pre}.{e}.{m[1]}.weight", t[e]
