"""A verify pass on the fast decode path's kernels: every row computed as plain fast decode
computes it, bit for bit, so an engine that speculates decodes on the fast path too.

What makes each part of a verify row equal to the same token decoded alone:

    linears     Baton's gemv kernel at any row count (`FastLinear`): one fixed summation
                order per output element, whatever the batch (cpu_kernels/gemv.cpp)
    norms       the RMSNorm kernel, row by row
    attention   the paged-attention kernel: all rows' K/V written first, then each row reads
                keys 0..its own position through its block table (no padding to the pass's
                longest row, no mask: a row reads what one-token decode reads)
    Mamba2,     the step kernel once per position j over the requests with a row there:
    DeltaNet    (a mixer that declares `has_kernel_step`, `protocol.RecurrentMixer`)
                `mixer.kernel_step(inputs, ctx, src, dst)` reads each state from slot src
                and writes the next one to slot dst (`schedule`); the input projections run
                over all rows at once before, out_proj after (`mixer.kernel_inputs`)
    MoE         the experts on the gemv kernel (a token's output does not depend on which
                other tokens chose its experts)

Slots of a chain of m rows (the contract of `verify.StateScratch`): position j reads the live
slot (j = 0) or scratch j-1 and writes scratch j, the last position writes the live slot, so
the live slot ends at the state after the last row without a copy and scratch j holds the
state after row j. A tree (tree.py): the root steps in the live slot, node j reads its
parent's slot and writes scratch j-1; its attention rows read their prompt and then their
path's storage positions, in order, through the kernel's key list (`tree_kernel_meta`). A
colocated engine's chains take the tree's slots (`VerifyPlan.live_first`): the live slot
then holds the state after the first row, so a step that keeps no draft (most, at low
acceptance) copies no state; one that keeps e >= 2 rows copies scratch e-2 once.
Pools that are not float32 keep the reference path (`applies`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from baton.model.layers import cpu_kernels, linear, step_kernels
from baton.model.protocol import RecurrentMixer


class KernelRows(NamedTuple):
    """One position of the pass: its rows and, per row, the slot read and the slot written."""

    rows: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    all_rows: bool
    """The rows are every row of the pass, in order (no gather, no scatter)."""
    span: tuple[int, int] | None = None
    """The rows as one consecutive range [lo, hi) (one request's chain: sliced, not
    gathered); None: scattered."""


def applies(pools, tree: bool = False) -> bool:
    """Whether verify passes of this thread take the kernels (and then equal plain fast
    decode): the fast decode path with both kernel modules built, float32 pools on the CPU
    (chains and trees alike; `tree` is kept for the callers' sake)."""
    if linear.decode_path() != "fast":
        return False
    if cpu_kernels.gemv() is None or step_kernels.kernels() is None:
        return False
    tensors = [*pools.state.values(), *([pools.kv] if pools.has_kv else [])]
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def schedule(plan, starts: list[int], dev) -> list[KernelRows]:
    """The recurrent layers' steps of `plan` (verify.VerifyPlan), one per row index j: a
    chain's position j, or a tree's node j (breadth-first, so its parent ran before it)."""
    counts = plan.counts
    total = sum(counts)
    parts = []
    for j in range(max(counts)):
        sel = [i for i, m in enumerate(counts) if m > j]
        if plan.parents is None and not plan.live_first:
            src = [plan.slots[i] if j == 0 else plan.scratch[i][j - 1] for i in sel]
            dst = [plan.scratch[i][j] if counts[i] > j + 1 else plan.slots[i] for i in sel]
        else:
            src, dst = _tree_slots(plan, sel, j)
        parts.append(([starts[i] + j for i in sel], src, dst))
    # one tensor for every position's rows and slots, each a view of it
    flat = torch.tensor([x for p in parts for v in p for x in v], dtype=torch.long, device=dev)
    out, at = [], 0
    for rows, _, _ in parts:
        n = len(rows)
        span = (rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else None
        out.append(KernelRows(flat[at : at + n], flat[at + n : at + 2 * n],
                              flat[at + 2 * n : at + 3 * n], rows == list(range(total)), span))
        at += 3 * n
    return out


def _tree_slots(plan, sel: list[int], j: int) -> tuple[list[int], list[int]]:
    """Slots of node j of the trees `sel` (tree.py's contract): the root steps in the live
    slot, node j >= 1 reads its parent's state (the live slot's, or scratch parent-1) and
    writes scratch j-1. A chain `live_first`: the same with row j's parent j-1."""
    if j == 0:
        live = [plan.slots[i] for i in sel]
        return live, live
    src, dst = [], []
    for i in sel:
        parent = plan.parents[i][j - 1] if plan.parents is not None else j - 1
        if parent >= j:
            raise ValueError(f"tree node {j} has parent {parent}: nodes must be breadth-first")
        src.append(plan.slots[i] if parent == 0 else plan.scratch[i][parent - 1])
        dst.append(plan.scratch[i][j - 1])
    return src, dst


def all_fit(model, pools) -> bool:
    """Whether every recurrent layer of `model` takes the kernel step (then a chain's verify
    pass may keep its first row's state in the live slot: `VerifyPlan.live_first`)."""
    index = pools.spec.state_index
    return all(m.has_kernel_step for m in model.modules()
               if isinstance(m, RecurrentMixer) and m.layer_idx in index)


def recurrent_rows(mixer, x: torch.Tensor, ctx, steps: list[KernelRows]) -> torch.Tensor:
    """One recurrent layer over the pass's rows x [R, H] (see the module docstring)."""
    inputs = mixer.kernel_inputs(x)
    y = None
    for p in steps:
        if p.all_rows:
            part = inputs
        elif p.span is not None:
            part = tuple(t[p.span[0]:p.span[1]] for t in inputs)
        else:
            part = tuple(t.index_select(0, p.rows) for t in inputs)
        out = mixer.kernel_step(part, ctx, p.src, p.dst)
        if p.all_rows:
            y = out
            continue
        if y is None:
            y = out.new_empty(x.shape[0], out.shape[1])
        if p.span is not None:
            y[p.span[0]:p.span[1]] = out
        else:
            y.index_copy_(0, p.rows, out)
    return mixer.out_proj(y)
