"""Mixture-of-experts layers: the routers (NemotronH's sigmoid group top-k, Qwen's softmax
top-k), the grouped expert kernel both use, and NemotronH's `E` mixer.

Only the experts a token is routed to run, one matmul pair per active expert:

    x [N, d] --router--> experts [N, k] (long), weights [N, k] (float32)
    pairs (token, choice) sorted by expert id    order = argsort(experts.flatten())
        sorted pairs   | e0 e0 e0 | e2 | e5 e5 | ...       runs, one per active expert
    expert e:  y[run_e] = down_e(act(up_e(x[token of each pair in run_e])))
    out [N, d] float32  index_add_(token, weight * y)  -> cast to x's dtype

The float32 accumulation is transformers' (its experts add into a float32 buffer).

On the fast decode path (`fused.fast_decoding`, Baton's CPU kernel built) each expert's two
matmuls (and NemotronH's router) take `cpu_kernels.gemv().linear`, which reads the stacked
weight [U, d_in] in place (already its [N, K] layout; float16 / bfloat16 stacks of
`model.weight_dtype` upcast in registers) and sums each output in a fixed order: a token's
expert output is then the same bits whichever other tokens share its experts (what a
speculative verify pass relies on), where MKL's sgemm rounds by the run's row count. It is
faster: one `grouped_linear` call a matmul for all active experts, the pair sort and the
weighted sum in C++ (`moe_sort`, `moe_combine`: no argsort / bincount / index_add_ calls;
measured figures in docs/performance.md, `python -m bench.step_profile`). The reference
path (`decode_path` reference) keeps torch.mm, bit for bit. A prefill on the fast path runs
the same torch.mm products, one expert a thread (`step_kernels` `grouped_mm`): the bits of the
loop at one thread, whatever the thread count. A plain decode step runs
each whole block, router to residual add, as one C++ call of the same ops in the same order
(`cpu_kernels/gemv_moe.h`, through `fast_decode`), the same bits as `forward`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.layers import cpu_kernels, fused, linear, step_kernels
from baton.model.layers.mlp import MLP, activate, activation
from baton.model.quant import packed as quant_packed


class MoEDims(Protocol):
    """What the routers and the `E` layer read of a model config (any family's)."""

    hidden_size: int
    mlp_bias: bool
    mlp_hidden_act: str
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


class Routing(NamedTuple):
    experts: torch.Tensor
    """[N, k] long: the experts chosen for each token."""
    weights: torch.Tensor
    """[N, k] float32: each choice's weight in the token's output."""


def sigmoid_group_topk(
    logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, n_group: int, topk_group: int,
    norm: bool, scale: float,
) -> Routing:
    """DeepSeek-V3 routing as transformers' NemotronHTopkRouter: the bias steers the choice
    only; the weights are the unbiased sigmoid scores of the chosen experts."""
    scores = sigmoid_by_element(logits) if fused.fast_decoding(logits) else logits.sigmoid()
    choice = scores + bias
    if topk_group < n_group:  # with every group kept the mask is a no-op
        n, e = choice.shape
        grouped = choice.view(n, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    experts = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(experts, weights * scale)


def sigmoid_by_element(t: torch.Tensor) -> torch.Tensor:
    """`t.sigmoid()` with every element through one code path, whatever t's size: torch's
    vectorised loop leaves a tail of up to 31 elements to its scalar sigmoid, which rounds
    differently, so a token's score would depend on how many tokens share the call. Read
    through a stride-2 view, the whole call takes the scalar loop (router-sized tensors)."""
    spaced = t.new_empty(*t.shape[:-1], 2 * t.shape[-1])[..., ::2]
    spaced.copy_(t)
    return spaced.sigmoid()


def softmax_topk(logits: torch.Tensor, *, top_k: int, norm: bool) -> Routing:
    """Qwen routing: softmax over all experts in float32, top-k, optionally renormalised."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


def run_experts(
    x: torch.Tensor, routing: Routing, up: torch.Tensor, down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor], first: int = 0, total: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted sum of the chosen experts' outputs for tokens x [N, d_in].

    up [E, U, d_in] (U = I, or 2I for gated experts whose `act` splits it), down [E, d_out, I].
    Expert parallel (`layers.moe_tp`): up / down hold experts [first, first + E) of `total`
    (0: just E); choices of other experts add nothing here (another rank runs them).
    Returns (out [N, d_out] in x's dtype, tokens routed to each of the `total` experts, long
    on the CPU).
    """
    kernel = _kernel(x, up, down)
    if kernel is not None:
        return _kernel_experts(kernel, x, routing, up, down, act, first, total)
    n, k = routing.experts.shape
    held = up.shape[0]
    flat = routing.experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=total or held).cpu()  # one sync: run lengths
    runs = counts[first:first + held].tolist()
    lo = int(counts[:first].sum())  # sorted by expert: the held experts' pairs are one run
    order = order[lo:lo + sum(runs)]
    token = order // k
    xs = x.index_select(0, token)
    grouped = _grouped(x, up, down)
    if grouped is not None:  # fast prefill: the same products, one expert a thread
        mine = counts[first:first + held]
        ys = grouped(activate(act, grouped(xs, up, mine)), down, mine)
    else:
        ys = torch.empty(len(order), down.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, c in enumerate(runs):
            if c:
                run = slice(start, start + c)
                torch.mm(activate(act, torch.mm(xs[run], _as(up[e], x).t())),
                         _as(down[e], x).t(), out=ys[run])
                start += c
    acc = torch.promote_types(x.dtype, torch.float32)  # half models sum in float32
    out = torch.zeros(n, down.shape[1], dtype=acc, device=x.device)
    w = routing.weights.reshape(-1)[order, None]
    out.index_add_(0, token, ys.mul_(w) if ys.dtype == w.dtype else ys * w)  # half: promoted
    return out.to(x.dtype), counts


def _kernel_experts(kernel, x, routing: Routing, up, down, act, first: int, total: int):
    """`run_experts` on Baton's kernel: the pairs sorted by expert in C++ (`moe_sort`: no
    sort call, no host round trip), every active expert's matmul in one `grouped_linear` call
    (each row's result independent of the run it is in; the first gathers each pair's token
    row itself), and the weighted sum as `index_add_` does it (`moe_combine`)."""
    n = routing.experts.shape[0]
    held = up.shape[0]
    pair, token, counts = kernel.moe_sort(routing.experts, first, held, total or held)
    mine = counts[first:first + held]
    ys = kernel.grouped_linear(act(kernel.grouped_linear(x, up, mine, token)), down, mine)
    out = kernel.moe_combine(ys, pair, token, routing.weights.reshape(-1), n)
    return out.to(x.dtype), counts


def _kernel(x: torch.Tensor, *weights: torch.Tensor):
    """Baton's CPU kernel module when the experts of this call take it (module doc), else
    None."""
    if any(w.device.type != "cpu" or w.stride(-1) != 1 for w in weights):
        return None
    packed_decode = (linear.packed_decoding() and linear.decode_path() == "fast"
                     and x.dtype == torch.float32 and x.device.type == "cpu"
                     and all(quant_packed.kind(w) is not None for w in weights))
    return cpu_kernels.gemv() if fused.fast_decoding(x) or packed_decode else None


def _grouped(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    """The step kernels' `grouped_mm` where a fast-path prefill's experts take it (float32
    stacks on the CPU), else None. It computes each expert's two products with the loop's
    torch.mm, MKL's sgemm, but runs the experts side by side, one a thread, where the loop
    splits each product over the threads (`step_kernels/prefill.cpp`: at 2 threads 1.05-1.16x
    the rate per core on the bench MoE models on a quiet machine, 1.5-2.4x beside other load)."""
    if not fused.fast_prefill(x) or any(w.dtype != x.dtype or w.device.type != "cpu"
                                        for w in (up, down)):
        return None
    return step_kernels.kernels().grouped_mm


def _as(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert's weight in x's dtype (half stacks of `model.weight_dtype`: upcast, exact;
    packed int8 / int4 stacks of `model.quantize`: decoded, `quant.packed.dense`)."""
    if quant_packed.kind(w) is not None:
        return quant_packed.dense(w, x.dtype).to(x.device)
    return w if w.dtype == x.dtype else w.to(x.dtype)


class TopkRouter(nn.Module):
    """`mixer.gate`: float32 weight [E, H] and the choice-only bias [E]."""

    def __init__(self, cfg: MoEDims):
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(e, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> Routing:
        x = x.float()
        kernel = _kernel(x, self.weight)
        logits = kernel.linear(x, self.weight) if kernel is not None else F.linear(x, self.weight)
        return self.route(logits)

    def route(self, logits: torch.Tensor) -> Routing:
        """The routing of router logits [N, E] (float32)."""
        c = self.cfg
        return sigmoid_group_topk(
            logits, self.e_score_correction_bias, top_k=c.num_experts_per_tok,
            n_group=c.n_group, topk_group=c.topk_group, norm=c.norm_topk_prob,
            scale=c.routed_scaling_factor,
        )


class Experts(nn.Module):
    """`mixer.experts`: non-gated experts stacked as transformers 5 stores them."""

    stacked = ("up_proj", "down_proj")
    """The expert weights `model.weight_dtype` stores narrower (`linear.cast_weights`)."""

    def __init__(self, cfg: MoEDims):
        super().__init__()
        e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
        d = cfg.moe_latent_size or cfg.hidden_size
        self.up_proj = nn.Parameter(torch.empty(e, i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))


class MoE(nn.Module):
    """Sigmoid group top-k routed squared-ReLU experts (optionally in a latent width) plus one
    shared expert on the layer's input (NemotronH's `E` layers). No KV, no state."""

    stateless = True

    def __init__(self, cfg: MoEDims, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.act = activation(cfg.mlp_hidden_act)
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg, layer_idx, cfg.moe_shared_expert_intermediate_size)
        self.latent = cfg.moe_latent_size is not None
        if self.latent:
            h, lat = cfg.hidden_size, cfg.moe_latent_size
            self.fc1_latent_proj = nn.Linear(h, lat, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(lat, h, bias=cfg.mlp_bias)
        # explicit device: the model is built on "meta" before its weights are assigned
        self.routed_tokens = torch.zeros(cfg.n_routed_experts, dtype=torch.long, device="cpu")
        """Tokens routed to each expert since start (expert load, for the worker's Stats)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        se = self.shared_experts
        # fast decode path: the router, the shared expert's up and the latent projection in
        # one kernel call
        outs = linear.fused_linears(flat, self.gate.weight, se.up_proj,
                                    *((self.fc1_latent_proj,) if self.latent else ()))
        if outs is None:
            routing = self.gate(flat)
            h = self.fc1_latent_proj(flat) if self.latent else flat
        else:
            routing = self.gate.route(outs[0])
            h = outs[2].contiguous() if self.latent else flat
        h, counts = run_experts(h, routing, self.experts.up_proj, self.experts.down_proj, self.act)
        self.routed_tokens.add_(counts)  # in place: no Module.__setattr__
        if self.latent:
            h = self.fc2_latent_proj(h)
        shared = self.shared_experts(x) if outs is None else se.down_proj(se.act(outs[1]))
        return h.view(shape) + shared.view(shape)


def routed_tokens(model: nn.Module) -> dict[int, list[int]]:
    """Tokens routed to each expert since start, by global layer id, for every MoE layer of
    `model` (a whole model or one pipeline stage)."""
    return {m.layer_idx: m.routed_tokens.tolist() for m in model.modules()
            if isinstance(getattr(m, "routed_tokens", None), torch.Tensor)}
