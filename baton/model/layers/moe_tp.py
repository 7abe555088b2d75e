"""MoE layers at tensor-parallel size t (`MoE`, `SoftmaxMoE`): the router (and
`SoftmaxMoE`'s shared-expert gate, `MoE`'s latent projections) replicated, the
routed experts split one of two ways, the shared expert split within, and ONE all-reduce
per layer for all of it.

    experts  whole experts per rank (expert parallel): rank r holds experts
             [r*E/t, (r+1)*E/t) at full width and runs only the (token, choice) pairs
             routed to them; E % t == 0
    within   every expert on every rank, its up (gate and up halves on their own) by
             rows I/t, its down by columns I/t: each rank runs every pair at 1/t width;
             I % t == 0

    partial_r = fc2(routed_r) + shared_down(act(shared_up_r(x)))     (no biases)
    out       = all_reduce(sum over r of partial_r) + fc2.bias + shared_down.bias

fc2 (latent -> hidden) is linear, so applying it to each rank's partial routed sum gives
the same total; every bias is added once, after the reduce. The shared expert: up rows
(and its bias) S/t per rank, down columns S/t. Qwen's shared output is scaled by its
replicated gate sigmoid(g(x)) before the reduce (a per-token scalar, so it distributes).

`routed_tokens` counts all E experts on every rank (the routing is replicated).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.errors import ConfigError
from baton.model.layers.linear import any_linear
from baton.model.layers.moe import MoE, Routing, run_experts, softmax_topk
from baton.model.layers.parallel import TPGroup
from baton.model.layers.softmax_moe import SoftmaxMoE
from baton.model.tp_shard import check_tp

MODES = ("experts", "within")
"""How routed experts are split over TP ranks (module doc); the first is the default."""


def check_split(cfg, tp: int, mode: str, experts: str, width: str, shared: str) -> None:
    """Refuse a split the model's sizes cannot take, before any rank starts: one line with
    the field, its value and the TP sizes that divide. `experts`, `width`, `shared` name
    the config fields of the expert count, expert width and shared-expert width."""
    if mode not in MODES:
        raise ConfigError(f"worker.moe_tp_split={mode!r} must be one of {list(MODES)}")
    need = [(experts if mode == "experts" else width,
             "whole experts per rank" if mode == "experts" else "each expert within"),
            (shared, "the shared expert within")]
    for field, why in need:
        value = getattr(cfg, field)
        if tp > 1 and value % tp:
            fits = ", ".join(str(t) for t in range(1, 17) if _fits(cfg, t, need))
            raise ConfigError(
                f"tensor_parallel_size={tp}: {field}={value} must be a multiple of {tp} to "
                f"split {why} (worker.moe_tp_split={mode!r}; sizes that divide this model: "
                f"{fits})")


def _fits(cfg, tp: int, need) -> bool:
    try:
        check_tp(cfg, tp)
    except ConfigError:
        return False
    return all(getattr(cfg, f) % tp == 0 for f, _ in need)


def _local_experts(mod: nn.Module, names: tuple[str, str], tp: TPGroup, mode: str,
                   num: int) -> tuple[int, int]:
    """Replace `mod`'s stacked expert parameters [E, a, b] (meta device) by the rank's
    shard; returns (first held expert, total experts)."""
    if tp.size == 1:
        return 0, num
    up, down = (getattr(mod, n) for n in names)
    e, u, d = up.shape
    if mode == "experts":
        per = e // tp.size
        setattr(mod, names[0], nn.Parameter(torch.empty(per, u, d)))
        setattr(mod, names[1], nn.Parameter(torch.empty(per, *down.shape[1:])))
        return tp.rank * per, num
    setattr(mod, names[0], nn.Parameter(torch.empty(e, u // tp.size, d)))
    setattr(mod, names[1], nn.Parameter(torch.empty(e, down.shape[1], down.shape[2] // tp.size)))
    return 0, num


def _split_linear(old: nn.Linear, tp: TPGroup, axis: int) -> nn.Linear:
    """Rows (axis 0: column parallel, bias split) or columns (axis 1: row parallel, bias
    whole: added once after the reduce) of `old`, as a plain Linear."""
    i, o = old.in_features, old.out_features
    if axis == 0:
        return nn.Linear(i, o // tp.size, bias=old.bias is not None)
    return nn.Linear(i // tp.size, o, bias=old.bias is not None)


def _no_bias(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return any_linear(x, lin.weight)  # a packed weight: read as stored


class TPMoE(MoE):
    """`MoE` on one TP rank (module doc)."""

    def __init__(self, cfg, layer_idx: int, tp: TPGroup, mode: str):
        super().__init__(cfg, layer_idx)
        self.tp, self.mode = tp, mode
        self.first, self.total = _local_experts(self.experts, ("up_proj", "down_proj"), tp,
                                                mode, cfg.n_routed_experts)
        s = self.shared_experts
        s.up_proj, s.down_proj = _split_linear(s.up_proj, tp, 0), _split_linear(s.down_proj,
                                                                                 tp, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.gate(flat)
        h = self.fc1_latent_proj(flat) if self.latent else flat
        h, counts = run_experts(h, routing, self.experts.up_proj, self.experts.down_proj,
                                self.act, self.first, self.total)
        self.routed_tokens += counts
        if self.latent:
            h = _no_bias(self.fc2_latent_proj, h)
        s = self.shared_experts
        y = self.tp.all_reduce(h + _no_bias(s.down_proj, s.act(s.up_proj(flat))))
        for b in (self.fc2_latent_proj.bias if self.latent else None, s.down_proj.bias):
            if b is not None:
                y = y + b
        return y.view(shape)


class TPSoftmaxMoE(SoftmaxMoE):
    """`SoftmaxMoE` on one TP rank (module doc); `experts.gate_up_proj` holds the
    rank's gate rows then its up rows, as the TP-1 one holds all gate rows then all up."""

    def __init__(self, cfg, layer_idx: int, renormalize: bool | None, tp: TPGroup, mode: str):
        super().__init__(cfg, layer_idx, renormalize)
        self.tp, self.mode = tp, mode
        self.first, self.total = _local_experts(self.experts, ("gate_up_proj", "down_proj"),
                                                tp, mode, cfg.num_experts)
        s = self.shared_expert
        s.gate_proj, s.up_proj = _split_linear(s.gate_proj, tp, 0), _split_linear(s.up_proj,
                                                                                   tp, 0)
        s.down_proj = _split_linear(s.down_proj, tp, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        r = softmax_topk(logits, top_k=self.top_k, norm=self.norm)
        routing = Routing(r.experts, r.weights.to(logits.dtype))
        routed, counts = run_experts(flat, routing, self.experts.gate_up_proj,
                                     self.experts.down_proj, self._swiglu, self.first,
                                     self.total)
        self.routed_tokens += counts
        shared = F.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return self.tp.all_reduce(routed + shared).view(shape)
