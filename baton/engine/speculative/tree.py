"""Tree drafts (`speculative.tree`, greedy requests): the MTP head proposes the top-k tokens
per node at each depth, the target verifies every node in one forward, and the path the
target's argmax follows is kept.

    rows of a request   0 = the last emitted token (the root), then the nodes breadth-first;
                        row r at storage position n + r, logical position n + depth(r)
    attention           row r reads keys 0..n-1 and the rows on its path (root .. r), in
                        position order: the keys plain decoding of that path reads
    recurrent layers    level by level (depth 0, 1, ...): a node starts from its parent's
                        state (copied into its own scratch slot), steps in place; the root
                        steps in the live slot
    after acceptance    path rows 0 = p_0, p_1 .. p_{e-1} are kept: their KV rows move from
                        storage n + p_j to n + j (every attention layer; j <= p_j, so in
                        order no source is overwritten first) and the deepest kept node's
                        state is promoted into the live slot (scratch slot p_{e-1} - 1)

A node's MTP head entry (drafting) sits likewise at storage n - 1 + r and reads the head's
entries 0..n-1 and its path's. The head's entries at n.. are rewritten by the next step's
first pass (pending hiddens), so nothing is moved for them.

Node budget: `max_total_draft_tokens`, and never more than the request may still emit - 1
(the blocks admission reserved). At each depth the children (top k_d of each expanded node)
with the highest summed log-probability are kept, up to the budget. Requests sampled at
temperature > 0 draft a chain (k = 1 at every depth) and use the rejection rule.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from baton.model.paged import AttnMeta, _tables, slot_context
from baton.model.protocol import VerifyPosition


class Tree(NamedTuple):
    tokens: list[int]
    """Node tokens, breadth-first (verify rows 1..)."""
    parents: list[int]
    """Parent row of each node (0 = the root)."""


def depths(parents: list[int]) -> list[int]:
    """Depth of every row (root 0) of a tree whose rows 1.. have `parents`."""
    d = [0]
    for p in parents:
        d.append(d[p] + 1)
    return d


def path(parents: list[int], row: int) -> list[int]:
    """Rows root .. `row`."""
    out = [row]
    while row:
        row = parents[row - 1]
        out.append(row)
    return out[::-1]


def path_meta(prefix: list[int], paths: list[list[int]], writes: list[int],
              positions: list[int], tables: list[list[int]], pools) -> AttnMeta:
    """One query per row: it writes its K/V at storage position writes[i] and reads keys
    0..prefix[i]-1 then the storage positions paths[i]; positions[i] is its logical position
    (rotary embeddings)."""
    dev = pools.kv.device
    tpb, kvh = pools.spec.tokens_per_block, pools.spec.num_kv_heads
    lens = [p + len(q) for p, q in zip(prefix, paths, strict=True)]
    num_keys = max(lens)
    need = [max(p, max(q, default=0) + 1, w + 1) for p, q, w in
            zip(prefix, paths, writes, strict=True)]
    tab = _tables(tables, need, pools)
    keys = torch.arange(num_keys, device=dev).repeat(len(prefix), 1)
    for i, (p, q) in enumerate(zip(prefix, paths, strict=True)):
        if q:
            keys[i, p : p + len(q)] = torch.tensor(q, device=dev)
    valid = torch.arange(num_keys, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
    keys = keys.masked_fill(~valid, 0)
    tok = tab.gather(1, keys // tpb) * (2 * tpb) + keys % tpb
    heads = torch.arange(kvh, device=dev)[None, :, None]
    k_rows = tok[:, None, :] * kvh + heads
    read_rows = torch.stack([k_rows, k_rows + tpb * kvh]).reshape(-1)
    mask = torch.zeros(len(prefix), 1, num_keys, device=dev, dtype=pools.spec.dtype)
    mask.masked_fill_(~valid[:, None, :], float("-inf"))
    w = torch.tensor(writes, device=dev)
    write_rows = tab.gather(1, (w // tpb)[:, None])[:, 0] * (2 * tpb) + w % tpb
    return AttnMeta(write_rows, read_rows, num_keys, mask,
                    torch.tensor(positions, dtype=torch.long, device=dev))


def tree_kernel_meta(plan, pools) -> AttnMeta:
    """`tree_verify_meta` for the attention kernel (fast path, `kernel_verify`): per row its
    block table, its key count and the storage positions of its keys (its prompt, then its
    path's rows, root to itself: the keys plain decoding of that path reads, in order)."""
    dev = pools.kv.device
    tpb = pools.spec.tokens_per_block
    paths, positions, tables, need = [], [], [], []
    for n, par, table in zip(plan.starts, plan.parents, plan.tables, strict=True):
        d = depths(par)
        for r in range(len(d)):
            paths.append((n, [n + q for q in path(par, r)]))
            positions.append(n + d[r])
            tables.append(table)
            need.append(n + r + 1)
    lens = [n + len(q) for n, q in paths]
    keys = torch.arange(max(lens), device=dev).repeat(len(paths), 1)
    for i, (n, q) in enumerate(paths):
        keys[i, n : n + len(q)] = torch.tensor(q, device=dev)
    tab = _tables(tables, need, pools)
    w = torch.tensor([q[-1] for _, q in paths], device=dev)
    write_rows = tab.gather(1, (w // tpb)[:, None])[:, 0] * (2 * tpb) + w % tpb
    return AttnMeta(write_rows, None, max(lens), None,
                    torch.tensor(positions, dtype=torch.long, device=dev), tab,
                    torch.tensor(lens, dtype=torch.long, device=dev), keys)


def tree_verify_meta(plan, pools) -> AttnMeta:
    """The target's attention over every row of a tree verify pass (see the module doc)."""
    prefix, paths, writes, positions, tables = [], [], [], [], []
    for n, par, table in zip(plan.starts, plan.parents, plan.tables, strict=True):
        d = depths(par)
        for r in range(len(d)):
            prefix.append(n)
            paths.append([n + q for q in path(par, r)])
            writes.append(n + r)
            positions.append(n + d[r])
            tables.append(table)
    return path_meta(prefix, paths, writes, positions, tables, pools)


def tree_levels(pools, plan, starts: list[int], dev) -> list:
    """The recurrent layers' steps of a tree pass, one per depth (`protocol.VerifyPosition`)."""

    levels: dict[int, list[tuple[int, int]]] = {}
    for i, par in enumerate(plan.parents):
        for r, d in enumerate(depths(par)):
            levels.setdefault(d, []).append((i, r))

    def longs(xs):
        return torch.tensor(xs, dtype=torch.long, device=dev)

    out = []
    for d in sorted(levels):
        sel = levels[d]
        rows = longs([starts[i] + r for i, r in sel])
        if d == 0:
            live = slot_context(pools, None, [plan.slots[i] for i, _ in sel])
            out.append(VerifyPosition(live, rows, None, None))
            continue
        parent = [plan.parents[i][r - 1] for i, r in sel]
        src = [plan.slots[i] if p == 0 else plan.scratch[i][p - 1]
               for (i, _), p in zip(sel, parent, strict=True)]
        own = [plan.scratch[i][r - 1] for i, r in sel]
        out.append(VerifyPosition(slot_context(pools, None, own), rows, None, None, longs(src)))
    return out


def accept_greedy(parents: list[int], tokens: list[int], target: list[int]) -> list[int]:
    """The rows the target's argmax follows from the root (target[r]: argmax at row r)."""
    children: dict[int, dict[int, int]] = {}
    for r, p in enumerate(parents, start=1):
        children.setdefault(p, {}).setdefault(tokens[r - 1], r)
    rows = [0]
    while (nxt := children.get(rows[-1], {}).get(target[rows[-1]])) is not None:
        rows.append(nxt)
    return rows


def relocate(pools, table: list[int], start: int, rows: list[int]) -> None:
    """Kept path rows: KV of storage start + rows[j] moved to start + j, for j in order."""
    tpb = pools.spec.tokens_per_block
    for j, r in enumerate(rows):
        if r != j:
            s, d = start + r, start + j
            pools.copy_token(table[s // tpb] * tpb + s % tpb, table[d // tpb] * tpb + d % tpb)
