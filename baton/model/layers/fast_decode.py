"""A decode step's layers on the fast path with as little Python as possible between kernel
calls (issue 24: at batch 1 the kernels run at llama.cpp's speed; the gap was the Python and
small ATen ops around them, which run with cold caches after every weight stream: ~1-2 us an
attribute lookup, ~10 us an op).

Each layer gets a plan once (`_plan`: a closure over its weights, scalars, kernel functions
and pool views, rebuilt when the weights may have changed, `linear._state["generation"]`, a
norm weight changed in place, or other pools are passed), and a step calls it:

    Qwen3.5     rms_norm -> DeltaNet: linear_split (qkv | a | b | z) -> deltanet_step
                            attention: linear_split (q | k | v) -> gated_attention (norms,
                            rotary, paged attention, sigmoid gate: one call)
                -> out_proj + residual (one `linear` call) -> rms_norm
                -> SwiGLU: linear_cat (gate | up) -> swiglu -> down_proj + residual
                   MoE: `qwen_moe` (router, top-k, experts, shared expert, residual: one call)
    NemotronH   rms_norm -> Mamba2: in_proj -> mamba2_step -> out_proj + residual
                            attention: linear_split (q | k | v) -> paged attention -> o_proj
                            MLP: up_proj with relu2 -> down_proj + residual
                            MoE: `nemotron_moe` (every group kept, no latent projection)

Bits: each call computes what the module path computes (the same kernels on the same inputs;
`linear`'s residual is torch's `h + y`, `swiglu` / `gated_attention`'s sigmoid round as
torch's ops do, relu2 and the rotary are exact element-wise products and sums, the MoE calls
run the module path's ATen ops in C++), so plain decode, a speculative verify pass (which
runs the modules: `speculative.verify`) and every test see the same numbers
(tests/unit/test_fast_decode_layers.py: each family, direct against modules, bit for bit). A
layer this does not cover (biases in fused projections, NemotronH's grouped routing or latent
MoE, another activation) runs its module.
"""

from __future__ import annotations

import torch

from baton.model.layers import cpu_kernels, fused, linear, step_kernels
from baton.model.layers.fast_blocks import mixer_part, mlp_part


def applies(h: torch.Tensor, pools) -> bool:
    """Whether this decode call's layers take `qwen_layer` / `nemotron_block`: the fast decode
    path, both kernel modules built, float32 pools on the CPU."""
    if not fused.fast_decoding(h) or h.dim() != 2:
        return False
    if cpu_kernels.gemv() is None or step_kernels.kernels() is None:
        return False
    tensors = [*pools.state.values(), *([pools.kv] if pools.has_kv else [])]
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


class _Plan:
    """A layer's cached closure and what it was built from."""

    __slots__ = ("generation", "pools", "norms", "run")

    def __deepcopy__(self, memo):  # a copied model builds its own (the closure holds ours)
        return None


def _plan(layer, pools, build):
    p = layer.__dict__.get("_baton_plan")
    if (p is None or p.pools is not pools or p.generation != linear._state["generation"]
            or any(w._version != v for w, v in p.norms)):
        p = _Plan()
        p.generation, p.pools = linear._state["generation"], pools
        p.run, norm_weights = build(layer, pools)
        p.norms = [(w, w._version) for w in norm_weights]
        layer.__dict__["_baton_plan"] = p
    return p.run


def qwen_layer(layer, h: torch.Tensor, ctx) -> torch.Tensor:
    """`DecoderLayer.forward(h, ctx, decode=True)` of Qwen3.5 / Qwen3.5-MoE."""
    return _plan(layer, ctx.pools, _qwen_plan)(h, ctx)


def nemotron_block(block, h: torch.Tensor, ctx) -> torch.Tensor:
    """`Block.forward(h, ctx, decode=True)` of NemotronH / NemotronH-MoE."""
    return _plan(block, ctx.pools, _nemotron_plan)(h, ctx)


def _qwen_plan(layer, pools):
    rms = step_kernels.kernels().rms_norm
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    s1, e1, s2, e2 = n1._scale(), n1.eps, n2._scale(), n2.eps
    mix, mixer_norms = mixer_part(layer.mixer, pools)
    ffn, _ = mlp_part(layer.mlp)

    def run(h, ctx):
        h = mix(rms(h, s1, e1), h, ctx)
        return ffn(rms(h, s2, e2), h)
    return run, [n1.weight, n2.weight, *mixer_norms]


def _nemotron_plan(block, pools):
    rms = step_kernels.kernels().rms_norm
    w, eps = block.norm.weight, block.norm.eps
    mixer = block.mixer
    if block.stateless:
        ffn, _ = mlp_part(mixer)

        def run(h, ctx):
            return ffn(rms(h, w, eps), h)
        return run, [w]
    mix, mixer_norms = mixer_part(mixer, pools)

    def run_mixer(h, ctx):
        return mix(rms(h, w, eps), h, ctx)
    return run_mixer, [w, *mixer_norms]

