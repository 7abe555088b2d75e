"""The softmax-routed MoE feed-forward (`SoftmaxMoE`; the Qwen MoE families' `mlp`): softmax
top-k router, SwiGLU experts stacked as transformers 5 stores them, and a shared SwiGLU expert
scaled by its own sigmoid gate.

    x [N, H] -> gate.weight [E, H] -> softmax (float32) -> top-k -> renormalise (always, or
    when norm_topk_prob) -> weights cast to x's dtype
    routed = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))       experts.gate_up_proj [E, 2I, H]
    out    = routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)

The block reads transformers' field names off the family's config: hidden_size, num_experts,
num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size, hidden_act and
norm_topk_prob.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.layers import linear
from baton.model.layers.gated_mlp import GatedMLP
from baton.model.layers.mlp import activation
from baton.model.layers.moe import Routing, run_experts, sigmoid_by_element, softmax_topk


class GatedExperts(nn.Module):
    """`mlp.experts`: gate and up halves fused per expert, first half the gate."""

    stacked = ("gate_up_proj", "down_proj")
    """The expert weights `model.weight_dtype` stores narrower (`linear.cast_weights`)."""

    def __init__(self, num: int, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, width))


class SoftmaxMoE(nn.Module):
    """Softmax top-k routed SwiGLU experts plus a sigmoid-gated shared expert; `renormalize`
    None reads the config's `norm_topk_prob`, True always renormalises."""

    stateless = True

    def __init__(self, cfg, layer_idx: int = 0, renormalize: bool | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k = cfg.num_experts_per_tok
        self.norm = bool(cfg.norm_topk_prob) if renormalize is None else renormalize
        h, width = cfg.hidden_size, cfg.moe_intermediate_size
        self.act = activation(cfg.hidden_act)
        self.gate = nn.Linear(h, cfg.num_experts, bias=False)
        self.experts = GatedExperts(cfg.num_experts, h, width)
        self.shared_expert = GatedMLP(h, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        # explicit device: the model is built on "meta" before its weights are assigned
        self.routed_tokens = torch.zeros(cfg.num_experts, dtype=torch.long, device="cpu")
        """Tokens routed to each expert since start (expert load, for the worker's Stats)."""

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        se = self.shared_expert
        # fast decode path: the router, the shared gate and the shared expert's gate / up in
        # one kernel call
        outs = linear.fused_linears(flat, self.gate, self.shared_expert_gate, se.gate_proj,
                                    se.up_proj)
        logits = self.gate(flat) if outs is None else outs[0]
        r = softmax_topk(logits, top_k=self.top_k, norm=self.norm)
        routing = Routing(r.experts, r.weights.to(logits.dtype))  # transformers casts back
        routed, counts = run_experts(flat, routing, self.experts.gate_up_proj,
                                     self.experts.down_proj, self._swiglu)
        self.routed_tokens.add_(counts)  # in place: no Module.__setattr__
        if outs is None:
            shared = F.sigmoid(self.shared_expert_gate(flat)) * se(flat)
        else:  # sigmoid_by_element: a token's gate whatever the batch (speculative verify)
            shared = sigmoid_by_element(outs[1]) * se.down_proj(F.silu(outs[2]) * outs[3])
        return (routed + shared).view(shape)


def feed_forward(cfg, layer: int) -> nn.Module:
    """Layer `layer`'s `mlp`: the MoE block where the family's config puts one (its
    `moe_layers`), else the dense SwiGLU."""
    if layer in getattr(cfg, "moe_layers", ()):
        return SoftmaxMoE(cfg, layer, renormalize=cfg.norm_topk_prob)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size)

