"""A decode step's layers on the fast path in one C++ call (issue 24: at batch 1 the kernels
run at llama.cpp's speed; the gap was the Python between them, ~1.5 ms of a 30 ms step on the
Zen 2, where each attribute lookup and op runs with caches cold after a weight stream).

Once per model (and again when the weights may have changed: `linear._state["generation"]`,
a folded-in norm weight changed in place, or other pools are passed) `_build` turns the layers
into parts, `h = h + body(rms_norm(h))` each (`fast_blocks`), and runs of covered parts into
one `DecodeLayers` program (step_kernels/layers.cpp); a step calls it with h, the state slots
and the attention metadata:

    Qwen3.5     rms_norm -> DeltaNet: linear_split (qkv | a | b | z) -> deltanet_step
                            attention: linear_split (q | k | v) -> gated_attention (norms,
                            rotary, paged attention, sigmoid gate: one call)
                -> out_proj + residual (one `linear` call) -> rms_norm
                -> SwiGLU: linear_cat (gate | up) -> swiglu -> down_proj + residual
                   MoE: `softmax_moe` (router, top-k, experts, shared expert, residual: one call)
    NemotronH   rms_norm -> Mamba2: in_proj -> mamba2_step -> out_proj + residual
                            attention: linear_split (q | k | v) -> paged attention -> o_proj
                            MLP: up_proj with relu2 -> down_proj + residual
                            MoE: `sigmoid_group_moe` (every group kept, no latent projection)

Bits: each part makes the kernel calls the module path's kernels make, on the same inputs
(`linear`'s residual is torch's `h + y`, `swiglu` / `gated_attention`'s sigmoid round as
torch's ops do, relu2 and the rotary are exact element-wise products and sums, the MoE calls
run the module path's ATen ops in C++), so plain decode, a speculative verify pass (which
runs the modules: `speculative.verify`) and every test see the same numbers
(tests/unit/model/layers/test_fast_decode_layers.py: each family, against the modules, bit for bit). A
part no body covers (biases in fused projections, NemotronH's grouped routing or latent MoE,
another activation, a tensor-parallel linear) runs its module from Python between programs.
"""

from __future__ import annotations

import torch

from baton.model.layers import cpu_kernels, fused, linear, step_kernels
from baton.model.layers.fast_blocks import ATTENTION, GATED_ATTENTION, mixer_part, mlp_part, program


def applies(h: torch.Tensor, pools) -> bool:
    """Whether this decode call's layers take `decode_layers`: the fast decode path, both
    kernel modules built, float32 state pools on the CPU (KV float32, bfloat16 or fp8)."""
    if not fused.fast_decoding(h) or h.dim() != 2:
        return False
    if cpu_kernels.gemv() is None or step_kernels.kernels() is None:
        return False
    tensors = [*pools.state.values(), *([pools.kv] if pools.has_kv else [])]
    kv_ok = not pools.has_kv or pools.kv.dtype in fused.KV_FORMATS  # bf16 / fp8 KV too
    return kv_ok and all((t.dtype == torch.float32 or t is pools.kv) and t.device.type == "cpu"
                         for t in tensors)


class _Plan:
    """A model's segments ((program's run, True) or (module fallback, False)) and what they
    were built from."""

    __slots__ = ("generation", "pools", "norms", "segments", "rotary", "attention")

    def __deepcopy__(self, memo):  # a copied model builds its own (the programs hold ours)
        return None


def _fallback(w, eps, m, mixer: bool):
    rms = step_kernels.kernels().rms_norm
    if mixer:
        return lambda h, ctx: h + m.decode(rms(h, w, eps), ctx)
    return lambda h, ctx: h + m(rms(h, w, eps))


def _build(layers, pools, parts_of) -> _Plan:
    p = _Plan()
    p.generation, p.pools, p.norms, p.segments = linear._state["generation"], pools, [], []
    p.rotary, p.attention, run = None, False, []
    rotaries = set()
    for layer in layers:
        for w, eps, watched, m, mixer in parts_of(layer):
            body = mixer_part(m, pools) if mixer else mlp_part(m)
            p.norms += [(t, t._version) for t in (watched, *(body.norms if body else ()))]
            if body is not None and body.rotary is not None:
                key = (m.rotary_dim, m.theta)
                if rotaries and key not in rotaries:  # one cos / sin a step: else the module
                    body = None
                else:
                    rotaries.add(key)
                    p.rotary = body.rotary
            if body is None:
                if run:
                    p.segments.append((program(run).run, True))
                    run = []
                p.segments.append((_fallback(w, eps, m, mixer), False))
                continue
            p.attention |= body.kind in (ATTENTION, GATED_ATTENTION)
            run.append((w, eps, body))
    if run:
        p.segments.append((program(run).run, True))
    return p


def _plan(layers, pools, parts_of) -> _Plan:
    """The plan of `layers` (a module list) over `pools`, built again when stale."""
    p = layers.__dict__.get("_baton_plan")
    if (p is None or p.pools is not pools or p.generation != linear._state["generation"]
            or any(w._version != v for w, v in p.norms)):
        p = _build(layers, pools, parts_of)
        layers.__dict__["_baton_plan"] = p
    return p


def program_only(layers, h: torch.Tensor, ctx, parts_of) -> torch.Tensor | None:
    """h through `layers` as `decode_layers` runs them, where every part is a program's (an
    MTP head's layers: `nemotron_h.mtp`, `qwen3_5.mtp`); None where one is not, or the
    attention metadata is not the kernel's (the caller then runs its modules)."""
    if not applies(h, ctx.pools):
        return None
    p = _plan(layers, ctx.pools, parts_of)
    if not all(is_program for _, is_program in p.segments):
        return None
    args = _kernel_args(p, h, ctx.attn)
    if args is None:
        return None
    slots = ctx.slots if ctx.slots is not None else _NO_SLOTS  # a head has no state
    for run, _ in p.segments:
        h = run(h, slots, *args)
    return h


_NO_SLOTS = torch.empty(0, dtype=torch.long)


def decode_layers(layers, h: torch.Tensor, ctx, parts_of) -> torch.Tensor:
    """h through every layer of `layers` (decode, fast path: `applies`); `parts_of(layer)`:
    the family's split of a layer into parts, (norm weight as the kernel reads it, eps,
    watched norm weight, module, is mixer) each (e.g. `nemotron_h.model.nemotron_parts`)."""
    p = _plan(layers, ctx.pools, parts_of)
    args = _kernel_args(p, h, ctx.attn)
    if args is None:  # not the kernel's metadata: every layer's module
        for layer in layers:
            h = layer(h, ctx, True)
        return h
    for run, is_program in p.segments:
        h = run(h, ctx.slots, *args) if is_program else run(h, ctx)
    return h


def _kernel_args(p, h: torch.Tensor, meta) -> tuple | None:
    """(tables, lens, keys, cos, sin) a program reads from the attention metadata `meta`;
    None where the plan has attention and `meta` is not the kernel's."""
    tables = lens = keys = cos = sin = None
    if meta is not None:
        tables, lens, keys = meta.tables, meta.lens, meta.keys
    if p.attention and tables is None:
        return None
    if p.rotary is not None:
        cos, sin = p.rotary(h, meta)
    return tables, lens, keys, cos, sin


def verify_rows(layers, h: torch.Tensor, ctx, parts_of, steps) -> torch.Tensor | None:
    """A speculative verify pass's rows h [R, H] through every layer of `layers` in one call
    of the program plain decode runs (`DecodeLayers.run_rows`): row-wise kernels over all rows
    at once, each recurrent part's step kernel once per position (`steps`:
    `kernel_verify.KernelRows`, read from and written to their slots), so every row is the
    bits plain fast decode gives it. None where a part runs its module (a fallback segment)
    or the attention metadata is not the kernel's: the caller runs the modules instead."""
    if not applies(h, ctx.pools):
        return None
    p = _plan(layers, ctx.pools, parts_of)
    if len(p.segments) != 1 or not p.segments[0][1]:
        return None
    args = _kernel_args(p, h, ctx.attn)
    if args is None:
        return None
    rows = [(None if s.all_rows or s.span is not None else s.rows,
             *(s.span if s.span is not None else (-1, -1)), s.all_rows, s.src, s.dst)
            for s in steps]
    return p.segments[0][0].__self__.run_rows(h, rows, *args)
