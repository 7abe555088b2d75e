"""Tensor-parallel building blocks: the group a rank belongs to and the layers that talk
over it. Each is a drop-in for the module a TP-1 model has, holding only its rank's shard.

    column parallel   in_proj / q,k,v / up_proj / lm_head: a plain nn.Linear whose output
                      rows are the rank's shard (no communication)
    row parallel      out_proj / o_proj / down_proj: local inputs -> partial sums, ONE
                      all-reduce per mixer and per MLP, the bias added once after it
    vocab embedding   the rank's rows of the table; ids elsewhere give zeros; all-reduce
                      (exact: one non-zero term per element)
    vocab head        local logits, gathered to rank 0 in rank order (exact: no sums)
    gated norm        Mamba2's grouped norm when the groups are replicated (n_groups 1):
                      the group spans every rank, so the sums of squares are all-reduced

`TPGroup.stats` counts collectives and their seconds (for `bench tp`). The collectives run
on gloo over host memory, or on NCCL in device memory when the ranks are CUDA ranks and torch
has NCCL (`collective_backend`; one GPU a rank, `rank_device`). Only gloo has run here: the
project's test machines have no GPU.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from baton.model.layers.linear import any_linear


def collective_backend(device: str) -> str:
    """The TP collectives' backend for ranks on `device`: NCCL for CUDA ranks where torch has
    it, gloo otherwise (CPU ranks, or a torch without NCCL: tensors staged through the host)."""
    return "nccl" if str(device).startswith("cuda") and dist.is_nccl_available() else "gloo"


def rank_device(device: str, rank: int) -> str:
    """TP rank `rank`'s device: CUDA ranks take one GPU each, counting from the configured one
    (`cuda` is `cuda:0`) and wrapping over the GPUs there are (NCCL refuses two ranks of a
    group on one GPU); any other device as configured."""
    if not str(device).startswith("cuda"):
        return device
    first = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{(first + rank) % max(1, torch.cuda.device_count())}"


class TPGroup:
    """This rank's place in a tensor-parallel group (size 1: no communication at all)."""

    def __init__(self, rank: int, size: int, group=None, root: int = 0,
                 backend: str = "gloo"):
        self.rank, self.size, self.group = rank, size, group
        self.root = root
        """Global rank of the group's rank 0 (a stage's leader under TP x PP)."""
        self.on_device = backend == "nccl"
        """NCCL: collectives on the tensors where they are, no host copies."""
        self.calls = 0
        self.seconds = 0.0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        host = t.device.type == "cpu" or self.on_device
        buf = t.contiguous() if host else t.cpu().contiguous()
        dist.all_reduce(buf, group=self.group)
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return buf.to(t.device) if buf is not t else buf

    def gather0(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenation of every rank's `t` along the last axis, on the group's rank 0
        (others get their own `t` back: only rank 0 samples)."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        buf = t.detach().contiguous() if self.on_device else t.detach().cpu().contiguous()
        parts = [torch.empty_like(buf) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(buf, parts, dst=self.root, group=self.group)
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=-1).to(t.device) if parts is not None else t

    def stats(self) -> dict:
        return {"collectives": self.calls, "collective_s": self.seconds}


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b: the rank's input columns of W."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(any_linear(x, self.weight))  # a packed weight: as stored
        return y + self.bias if self.bias is not None else y


def row_parallel(owner: nn.Module, names: tuple[str, ...], tp: TPGroup) -> None:
    """`owner`'s output projections among `names` as row-parallel ones (one all-reduce)."""
    for name in names:
        old = getattr(owner, name, None)
        if old is not None:
            setattr(owner, name, RowParallelLinear(old.in_features, old.out_features,
                                                   old.bias is not None, tp))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the full table."""

    def __init__(self, num_embeddings: int, dim: int, start: int, tp: TPGroup):
        super().__init__(num_embeddings, dim)
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        e = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(e * inside[..., None].to(e.dtype))


class VocabParallelHead(nn.Linear):
    """The rank's vocab rows of the LM head; full logits on rank 0."""

    def __init__(self, hidden: int, vocab_local: int, tp: TPGroup):
        super().__init__(hidden, vocab_local, bias=False)
        self.tp = tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.gather0(F.linear(h, self.weight))


class ReplicatedGroupGatedNorm(nn.Module):
    """`norm(x * silu(gate))` over ONE group that spans every rank (n_groups == 1): the
    mean of squares is the all-reduced sum over all ranks' channels / the group size."""

    def __init__(self, local_size: int, group_size: int, eps: float, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_size))
        self.group_size, self.eps, self.tp = group_size, eps, tp

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(gate.float())
        ss = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True))
        x = x * torch.rsqrt(ss / self.group_size + self.eps)
        return self.weight * x.to(dtype)
