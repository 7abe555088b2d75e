"""What `fast_decode` hands the layer runner (`step_kernels/layers.cpp`, `DecodeLayers`) for
one part of a layer: a mixer's (`mixer_part`: h -> h + mixer(x)) or a feed-forward's
(`mlp_part`: h -> h + mlp(x)), x = the part's RMSNorm of h. A `Body` is the part's kind and
the tensors (weights as the module path's kernels read them, `FastLinear._packed`; the
layer's pool views), integers and floats the runner's body of that kind reads, in its order
(layers.cpp lists them); plus the norm weights it folded in (their in-place changes rebuild
the plan). A layer a body does not cover gets None and runs its module (see `fast_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from baton.model.layers import cpu_kernels, step_kernels
from baton.model.layers.attention import Attention
from baton.model.layers.deltanet import GatedDeltaNet
from baton.model.layers.gated_attention import GatedAttention
from baton.model.layers.gated_mlp import GatedMLP
from baton.model.layers.gated_norms import HeadGatedRMSNorm
from baton.model.layers.linear import FastLinear
from baton.model.layers.mamba2 import Mamba2Mixer
from baton.model.layers.mlp import MLP
from baton.model.layers.moe import MoE
from baton.model.layers.norms import GatedRMSNorm
from baton.model.layers.softmax_moe import SoftmaxMoE
from baton.model.paged import StepContext

DELTANET, MAMBA2, GATED_ATTENTION, ATTENTION, SWIGLU, RELU2, SOFTMAX_MOE, SIGMOID_GROUP_MOE = range(1, 9)
"""The part kinds of layers.cpp (`Kind`)."""


@dataclass
class Body:
    kind: int
    tensors: list
    """Without the part's norm weight (the runner's t[0]); None where a bias is absent."""
    ints: list
    floats: list
    """Without the part's norm eps (the runner's f[0])."""
    norms: list
    """Norm weights folded in (a plan over them is stale once one changes in place)."""
    rotary: object = None
    """Gated attention: the module's `rotary(x, meta)` (cos, sin of the step's positions)."""


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


def mixer_part(m, pools) -> Body | None:
    """The body of a mixer whose class (exactly: a tensor-parallel subclass runs its module)
    has one, else None."""
    build = MIXER_BODIES.get(type(m))
    return build(m, pools) if build is not None else None


def _deltanet(m, pools):
    ws = [_weight(p) for p in (m.in_proj_qkv, m.in_proj_a, m.in_proj_b, m.in_proj_z)]
    out = _out(m.out_proj)
    if None in ws or out is None or type(m.norm) is not HeadGatedRMSNorm:
        return None
    conv, rec = m._pools(StepContext(pools, None, None))
    return Body(DELTANET, [*ws, *out, conv, rec, m.conv1d.weight[:, 0], m.dt_bias, m.A_log,
                           m.norm.weight], [m.hk, m.hv, m.dk, m.dv], [m.norm.eps], [])


def _mamba2(m, pools):
    inp, out = _out(m.in_proj), _out(m.out_proj)
    if inp is None or out is None or type(m.norm) is not GatedRMSNorm:
        return None
    conv, ssm = m._pools(StepContext(pools, None, None))
    cfg, (lo, hi) = m.cfg, m.cfg.dt_limit
    return Body(MAMBA2, [*inp, *out, conv, ssm, m.conv1d.weight[:, 0], m.conv1d.bias, m.dt_bias,
                         m.A_log, m.D, m.norm.weight],
                [cfg.mamba_intermediate, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups,
                 cfg.ssm_state_size, m.norm.group_size], [float(lo), float(hi), m.norm.eps], [])


def _gated_attn(m, pools):
    ws = [_weight(p) for p in (m.q_proj, m.k_proj, m.v_proj)]
    qn, kn, out = m.q_norm, m.k_norm, _out(m.o_proj)
    if None in ws or out is None or qn.eps != kn.eps:
        return None
    pool = StepContext(pools, None, None).kv(m.layer_idx)
    return Body(GATED_ATTENTION, [*ws, qn._scale(), kn._scale(), pool, *out], [],
                [qn.eps, m.scale], [qn.weight, kn.weight], rotary=m.rotary)


def _attention(m, pools):
    ws, out = [_weight(p) for p in (m.q_proj, m.k_proj, m.v_proj)], _out(m.o_proj)
    if None in ws or out is None:
        return None
    pool = StepContext(pools, None, None).kv(m.layer_idx)
    return Body(ATTENTION, [*ws, pool, *out], [m.num_heads, m.head_dim], [m.scale], [])


def mlp_part(m) -> Body | None:
    """The body of a feed-forward whose class (exactly) has one, else None."""
    build = FEED_FORWARD_BODIES.get(type(m))
    return build(m) if build is not None else None


def _swiglu_mlp(m):
    ws = [_weight(m.gate_proj), _weight(m.up_proj), _weight(m.down_proj)]
    return None if None in ws else Body(SWIGLU, ws, [], [], [])


def _relu2_mlp(m):
    up, down = _out(m.up_proj), _out(m.down_proj)
    if m.act.__name__ != "_relu2" or up is None or down is None:
        return None
    return Body(RELU2, [*up, *down], [], [], [])


def _stacks_ok(*stacks) -> bool:
    return all(t.stride(-1) == 1 and t.device.type == "cpu" for t in stacks)


def _softmax_moe(m):
    se = m.shared_expert
    ws = [_weight(p) for p in (m.gate, m.shared_expert_gate, se.gate_proj, se.up_proj,
                               se.down_proj)]
    up, down = m.experts.gate_up_proj, m.experts.down_proj
    if None in ws or m.act is not F.silu or not _stacks_ok(up, down):
        return None
    return Body(SOFTMAX_MOE, [*ws, up, down, m.routed_tokens], [m.top_k, int(m.norm)], [], [])


def _sigmoid_group_moe(m):
    c, se, ex = m.gate.cfg, m.shared_experts, m.experts
    if (c.topk_group < c.n_group or m.latent or m.act.__name__ != "_relu2"
            or se.act.__name__ != "_relu2" or None in (_weight(se.up_proj),
                                                       _weight(se.down_proj))
            or not _stacks_ok(ex.up_proj, ex.down_proj, m.gate.weight)):
        return None
    return Body(SIGMOID_GROUP_MOE, [m.gate.weight, m.gate.e_score_correction_bias,
                                    _weight(se.up_proj), _weight(se.down_proj), ex.up_proj,
                                    ex.down_proj, m.routed_tokens],
                [c.num_experts_per_tok, int(c.norm_topk_prob)],
                [float(c.routed_scaling_factor)], [])


MIXER_BODIES = {GatedDeltaNet: _deltanet, Mamba2Mixer: _mamba2, GatedAttention: _gated_attn,
                Attention: _attention}
"""Mixer class -> its body's builder (m, pools) -> Body | None: a new layer kind adds one."""
FEED_FORWARD_BODIES = {GatedMLP: _swiglu_mlp, MLP: _relu2_mlp, SoftmaxMoE: _softmax_moe,
                       MoE: _sigmoid_group_moe}
"""Feed-forward class -> its body's builder (m) -> Body | None."""


def program(parts) -> object:
    """A `DecodeLayers` of `parts`: (norm weight, eps, Body) each."""
    runner = step_kernels.kernels().DecodeLayers(cpu_kernels.gemv().api())
    for w, eps, b in parts:
        runner.add(b.kind, [w, *b.tensors], b.ints, [float(eps), *b.floats])
    return runner
