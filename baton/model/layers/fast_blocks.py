"""The closures `fast_decode` builds once per layer: a mixer's (`mixer_part`: x, h, ctx ->
h + mixer(x)) and a feed-forward's (`mlp_part`: x, h -> h + mlp(x)), each over the weights
as the module path's kernels read them (`FastLinear._packed`), the layer's pool views and
scalars, calling the kernel functions directly. Each returns (closure, norm weights it
folded in: their in-place changes rebuild the plan). A layer a closure does not cover (see
`fast_decode`) gets one that runs its module.
"""

from __future__ import annotations

import torch.nn.functional as F

from baton.model.layers import cpu_kernels, fused, step_kernels
from baton.model.layers.linear import FastLinear
from baton.model.paged import StepContext


def _weight(lin):
    """A plain bias-free linear's weight as the kernel reads it; None if it has a bias or is
    not a plain `FastLinear` (a tensor-parallel one all-reduces in its forward)."""
    return lin._packed() if type(lin) is FastLinear and lin.bias is None else None


def _out(proj):
    """(weight, bias) of a plain linear as `FastLinear` passes them to the kernel; None if it
    is not one."""
    if type(proj) is not FastLinear:
        return None
    return proj._packed(), None if proj.bias is None else proj.bias.float()


def mixer_part(m, pools):
    kind = type(m).__name__
    build = {"GatedDeltaNet": _deltanet, "Mamba2Mixer": _mamba2, "GatedAttention": _gated_attn,
             "Attention": _attention}.get(kind)
    part = build(m, pools) if build is not None else None
    if part is None:
        def module(x, h, ctx):
            return h + m.decode(x, ctx)
        return module, []
    return part


def _deltanet(m, pools):
    ws = [_weight(p) for p in (m.in_proj_qkv, m.in_proj_a, m.in_proj_b, m.in_proj_z)]
    out = _out(m.out_proj)
    if None in ws or out is None or type(m.norm).__name__ != "HeadGatedRMSNorm":
        return None
    g, s = cpu_kernels.gemv(), step_kernels.kernels()
    split, step, lin = g.linear_split, s.deltanet_step, g.linear
    ctx0 = StepContext(pools, None, None)
    conv, rec = ctx0.state(m.layer_idx, "conv"), ctx0.state(m.layer_idx, "recurrent")
    consts = (m.conv1d.weight[:, 0], m.dt_bias, m.A_log, m.norm.weight, m.hk, m.hv, m.dk, m.dv,
              m.norm.eps)
    out_w, out_b = out

    def run(x, h, ctx):
        qkv, a, b, z = split(x, ws)
        o = step(qkv, conv, rec, ctx.slots, ctx.slots, a, b, z, *consts)
        return lin(o, out_w, out_b, -1, h)
    return run, []


def _mamba2(m, pools):
    inp, out = _out(m.in_proj), _out(m.out_proj)
    if inp is None or out is None or type(m.norm).__name__ != "GatedRMSNorm":
        return None
    g, s = cpu_kernels.gemv(), step_kernels.kernels()
    step, lin = s.mamba2_step, g.linear
    ctx0 = StepContext(pools, None, None)
    conv, ssm = ctx0.state(m.layer_idx, "conv"), ctx0.state(m.layer_idx, "ssm")
    cfg, (lo, hi) = m.cfg, m.cfg.dt_limit
    consts = (m.conv1d.weight[:, 0], m.conv1d.bias, m.dt_bias, m.A_log, m.D, m.norm.weight,
              cfg.mamba_intermediate, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups,
              cfg.ssm_state_size, float(lo), float(hi), m.norm.group_size, m.norm.eps)
    (in_w, in_b), (out_w, out_b) = inp, out

    def run(x, h, ctx):
        y = step(lin(x, in_w, in_b), conv, ssm, ctx.slots, ctx.slots, *consts)
        return lin(y, out_w, out_b, -1, h)
    return run, []


def _gated_attn(m, pools):
    ws = [_weight(p) for p in (m.q_proj, m.k_proj, m.v_proj)]
    qn, kn, out = m.q_norm, m.k_norm, _out(m.o_proj)
    if None in ws or out is None or qn.eps != kn.eps:
        return None
    g, s = cpu_kernels.gemv(), step_kernels.kernels()
    split, attend, lin = g.linear_split, s.gated_attention, g.linear
    pool = StepContext(pools, None, None).kv(m.layer_idx)
    qs, ks, eps, scale, rotary = qn._scale(), kn._scale(), qn.eps, m.scale, m.rotary
    out_w, out_b = out

    def run(x, h, ctx):
        meta = ctx.attn
        if meta.tables is None:  # not the kernel's metadata: the module's own path
            return h + m.decode(x, ctx)
        q, k, v = split(x, ws)
        cos, sin = rotary(x, meta)
        out = attend(q, k, v, qs, ks, eps, cos, sin, pool, meta.tables, meta.lens, scale,
                     meta.keys)
        return lin(out, out_w, out_b, -1, h)
    return run, [qn.weight, kn.weight]


def _attention(m, pools):
    ws, out = [_weight(p) for p in (m.q_proj, m.k_proj, m.v_proj)], _out(m.o_proj)
    if None in ws or out is None:
        return None
    g = cpu_kernels.gemv()
    split, lin, paged = g.linear_split, g.linear, fused.paged_attention
    pool = StepContext(pools, None, None).kv(m.layer_idx)
    heads, hd, scale = m.num_heads, m.head_dim, m.scale
    out_w, out_b = out

    def run(x, h, ctx):
        q, k, v = split(x, ws)
        out = paged(scale, q.view(q.shape[0], heads, hd), k, v, pool, ctx.attn)
        return lin(out, out_w, out_b, -1, h)
    return run, []


def mlp_part(m):
    kind = type(m).__name__
    build = {"GatedMLP": _swiglu_mlp, "MLP": _relu2_mlp, "QwenSparseMoe": _qwen_moe,
             "MoE": _nemotron_moe}.get(kind)
    part = build(m) if build is not None else None
    if part is None:
        def module(x, h):
            return h + m(x)
        return module, []
    return part


def _swiglu_mlp(m):
    gw, uw, dw = _weight(m.gate_proj), _weight(m.up_proj), _weight(m.down_proj)
    if None in (gw, uw, dw):
        return None
    g, s = cpu_kernels.gemv(), step_kernels.kernels()
    cat, swiglu, lin, ws = g.linear_cat, s.swiglu, g.linear, [gw, uw]

    def run(x, h):
        return lin(swiglu(cat(x, ws)), dw, None, -1, h)
    return run, []


def _relu2_mlp(m):
    up, down = _out(m.up_proj), _out(m.down_proj)
    if m.act.__name__ != "_relu2" or up is None or down is None:
        return None
    lin = cpu_kernels.gemv().linear
    (up_w, up_b), (down_w, down_b) = up, down

    def run(x, h):
        return lin(lin(x, up_w, up_b, -1, None, True), down_w, down_b, -1, h)
    return run, []


def _stacks_ok(*stacks) -> bool:
    return all(t.stride(-1) == 1 and t.device.type == "cpu" for t in stacks)


def _qwen_moe(m):
    se = m.shared_expert
    ws = [_weight(p) for p in (m.gate, m.shared_expert_gate, se.gate_proj, se.up_proj,
                               se.down_proj)]
    up, down = m.experts.gate_up_proj, m.experts.down_proj
    if None in ws or m.act is not F.silu or not _stacks_ok(up, down):
        return None
    moe, args = cpu_kernels.gemv().qwen_moe, (*ws, up, down, m.top_k, m.norm, m.routed_tokens)

    def run(x, h):
        return moe(x, *args, h)
    return run, []


def _nemotron_moe(m):
    c, se, ex = m.gate.cfg, m.shared_experts, m.experts
    if (c.topk_group < c.n_group or m.latent or m.act.__name__ != "_relu2"
            or se.act.__name__ != "_relu2" or None in (_weight(se.up_proj),
                                                       _weight(se.down_proj))
            or not _stacks_ok(ex.up_proj, ex.down_proj, m.gate.weight)):
        return None
    moe = cpu_kernels.gemv().nemotron_moe
    args = (m.gate.weight, m.gate.e_score_correction_bias, _weight(se.up_proj),
            _weight(se.down_proj), ex.up_proj, ex.down_proj, c.num_experts_per_tok,
            c.norm_topk_prob, float(c.routed_scaling_factor), m.routed_tokens)

    def run(x, h):
        return moe(x, *args, h)
    return run, []
