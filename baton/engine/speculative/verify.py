"""The target's verify pass: m_r consecutive positions of each request in one forward, with the
recurrent state kept after every position so a rejected draft rolls back exactly.

Numerics are the decode path's, position by position, so a verified token is the one plain
decoding would have produced. On the fast decode path (float32 pools, the kernels built)
every layer runs decode's own kernels, chains and trees: `kernel_verify`. Otherwise (the reference path,
which an engine whose passes cannot take the kernels runs on):

    rows (r, j)    request r's position n_r + j, ordered by request then position
    norms, MLPs    every row at once (row-wise ops)
    attention      `Attention.decode` over the rows as independent one-token queries
                   (`decode_meta`): row (r, j) sees keys 0..n_r+j, later ones masked
    recurrent      the layer's own `verify_positions` (`protocol.RecurrentMixer`): its
                   step once per position j over the requests with m_r > j, in place on
                   their live slots; after position j (j < m_r - 1) the state is copied
                   into the request's scratch slot j (`StateScratch`). Mamba2 runs its
                   projections, dt and gated norm over every row at once
                   (`layers/mamba2_verify.py`), other kinds their `decode` per position

After acceptance, `StateScratch.restore` puts scratch slot e back into the live slot when
fewer than all m_r positions are kept (all kept: the live slot holds the right state).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from baton.engine.speculative import kernel_verify
from baton.model.layers import fast_decode, fused
from baton.model.layers.linear import decode_scope
from baton.model.paged import StepContext, decode_meta, slot_context
from baton.model.pools import Pools
from baton.model.protocol import VerifyPosition


class VerifyRow(NamedTuple):
    """One request of a verify pass."""

    tokens: list[int]
    """Tokens at positions start..start+m-1 (the last emitted token, then the drafts)."""
    start: int
    slot: int
    table: list[int]
    parents: tuple[int, ...] = ()
    """Tree drafts (tree.py): the parent row of each row after the first (0 = the last
    emitted token); empty: a chain (row j's parent is row j-1)."""


class StateScratch:
    """Per-position recurrent states of one verify pass, in the pools' own slots
    `first_slot ..`: `rows_per_request` slots for each of `max_requests` requests (the cache
    manager never hands them out: `reserved_slots`)."""

    def __init__(self, pools: Pools, first_slot: int, max_requests: int, rows_per_request: int):
        self.pools = pools
        self.first_slot = first_slot
        self.rows_per_request = rows_per_request
        self.max_requests = max_requests

    @property
    def num_slots(self) -> int:
        return self.max_requests * self.rows_per_request if self.pools.has_state else 0

    def slot(self, request: int, position: int) -> int:
        return self.first_slot + request * self.rows_per_request + position

    def restore(self, request: int, position: int, slot: int) -> None:
        """Live slot `slot` <- the state after `position` of the pass's request `request`."""
        self.pools.copy_slot(self.slot(request, position), slot)


class VerifyPlan(NamedTuple):
    """Where the rows of a verify pass sit, as plain lists (a pipeline stage gets it in its
    micro-batch's control message): per request its row count, first position, live slot,
    block table and the scratch slots of its positions but the last."""

    counts: list[int]
    starts: list[int]
    slots: list[int]
    tables: list[list[int]]
    scratch: list[list[int]]
    parents: list[list[int]] | None = None
    """A tree pass (tree.py): per request the parent row of each row after the first, and
    scratch[i][r-1] then holds the state after row r; None: chains."""
    live_first: bool = False
    """A chain whose live slot keeps the state after its first row, scratch[i][j-1] the one
    after row j (a tree's slots; the kernel path only, `kernel_verify.schedule`): a step
    that rejects every draft, the common case, then copies no state. False: the live slot
    ends after the last row, scratch[i][j] holds the state after row j."""

    @classmethod
    def of(cls, rows: list[VerifyRow], scratch: StateScratch, tree: bool = False,
           live_first: bool = False) -> VerifyPlan:
        parents = [list(r.parents or range(len(r.tokens) - 1)) for r in rows] if tree else None
        return cls([len(r.tokens) for r in rows], [r.start for r in rows],
                   [r.slot for r in rows], [list(r.table) for r in rows],
                   [[scratch.slot(i, j) for j in range(len(r.tokens) - 1)]
                    for i, r in enumerate(rows)], parents, live_first and not tree)


def verify_forward(model, pools: Pools, rows: list[VerifyRow], scratch: StateScratch,
                   tree: bool = False, live_first: bool = False):
    """Run every row's tokens; returns (final-normed hidden [R, H], float32 logits [R, vocab])
    with R = total tokens, in row order. Leaves each live slot at the state after its last
    token and the scratch rows at the states after the earlier ones (`tree`, or a chain
    `live_first` on the kernel path: the live slot after the first row, scratch row r-1
    after row r; see tree.py)."""
    ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.long,
                       device=pools.kv.device)
    plan = VerifyPlan.of(rows, scratch, tree, live_first)
    h = verify_layers(model, pools, plan, embed(model, ids))
    with decode_scope():  # as `model.decode` runs its final norm and LM head
        hidden = final_norm(model, h)
        return hidden, model.lm_head(hidden).float()


def embed(model, ids: torch.Tensor) -> torch.Tensor:
    """The token embeddings of a whole model or a pipeline stage (`protocol.Stage`)."""
    table = model.embedding
    return table(ids.to(table.weight.device))


def final_norm(model, h: torch.Tensor) -> torch.Tensor:
    return model.final_norm(h)


def verify_layers(model, pools: Pools, plan: VerifyPlan, h: torch.Tensor) -> torch.Tensor:
    """The model's (or a stage's) layers over the verify rows' input hiddens h [R, H]
    (`pools`: the layers' own tensors, a stage's local pools)."""
    with decode_scope():  # decode's kernels (BATON_DECODE_PATH) and their rounding
        return _verify_layers(model, pools, plan, h)


def _verify_layers(model, pools: Pools, plan: VerifyPlan, h: torch.Tensor) -> torch.Tensor:
    counts = plan.counts
    starts = [sum(counts[:i]) for i in range(len(counts))]
    dev = pools.kv.device
    attn = None
    tree = plan.parents is not None
    if kernel_verify.applies(pools, tree):  # plain fast decode's kernels, bit for bit
        steps = kernel_verify.schedule(plan, starts, dev)
        if tree and pools.has_kv:
            from baton.engine.speculative.tree import tree_kernel_meta

            meta = tree_kernel_meta(plan, pools)
        else:
            meta = _chain_meta(plan, pools, fused.kernel_attention(pools))
        flat = StepContext(pools, meta, None)
        parts_of = getattr(model, "fast_parts", None)
        if parts_of is not None and hasattr(model, "layer_list"):
            # every layer in one call of plain decode's program (`fast_decode.verify_rows`)
            out = fast_decode.verify_rows(model.layer_list, h, flat, parts_of, steps)
            if out is not None:
                return out

        def on_kernels(mixer, x: torch.Tensor) -> torch.Tensor:
            if mixer.layer_idx in pools.spec.attn_index:
                return mixer.decode(x, flat)
            if mixer.has_kernel_step:
                return kernel_verify.recurrent_rows(mixer, x, flat, steps)
            if tree:
                from baton.engine.speculative.tree import tree_levels

                per_pos = tree_levels(pools, plan, starts, dev)
            else:
                per_pos = _positions(pools, plan, starts, dev)
            return mixer.verify_positions(x, per_pos, counts, tree)

        return _run_layers(model, h, on_kernels)
    if tree:  # a tree: every node reads its path, starts from its parent
        from baton.engine.speculative.tree import tree_levels, tree_verify_meta

        attn = tree_verify_meta(plan, pools) if pools.has_kv else None
        per_pos = tree_levels(pools, plan, starts, dev)
    else:
        attn = _chain_meta(plan, pools)
        per_pos = _positions(pools, plan, starts, dev)
    flat = StepContext(pools, attn, None)

    def mix(mixer, x: torch.Tensor) -> torch.Tensor:
        if mixer.layer_idx in pools.spec.attn_index:
            return mixer.decode(x, flat)
        return mixer.verify_positions(x, per_pos, counts, tree)

    return _run_layers(model, h, mix)


def _chain_meta(plan: VerifyPlan, pools: Pools, lean: bool = False):
    """Attention metadata of a chain pass: its rows as independent one-token queries
    (`decode_meta`), row (r, j) at position n_r + j; None without attention layers."""
    if not pools.has_kv:
        return None
    counts = plan.counts
    pos = torch.tensor([s + j for s, m in zip(plan.starts, counts, strict=True)
                        for j in range(m)], dtype=torch.long, device=pools.kv.device)
    tables = [t for t, m in zip(plan.tables, counts, strict=True) for _ in range(m)]
    return decode_meta(pos, tables, pools, lean=lean)


def _run_layers(model, h: torch.Tensor, mix) -> torch.Tensor:
    for layer in model.blocks():  # each layer's own residual structure (`Layer.run_mixed`)
        h = layer.run_mixed(h, mix)
    return h


def _positions(pools, plan: VerifyPlan, starts, dev) -> list[VerifyPosition]:
    def longs(xs):
        return torch.tensor(xs, dtype=torch.long, device=dev)

    counts = plan.counts
    out = []
    for j in range(max(counts)):
        sel = [i for i, m in enumerate(counts) if m > j]
        keep = [i for i in sel if counts[i] > j + 1]
        out.append(VerifyPosition(
            slot_context(pools, None, [plan.slots[i] for i in sel]),
            longs([starts[i] + j for i in sel]),
            longs([plan.scratch[i][j] for i in keep]) if keep else None,
            longs([plan.slots[i] for i in keep]) if keep else None,
        ))
    return out
