"""Per-call views of the paged pools: where each new token's K/V goes, what each query reads.

A sequence's position p lives in block `block_table[p // tpb]` at offset `p % tpb`:

    block_table = [7, 2, 9]   tpb = 4
    positions   0 1 2 3 | 4 5 6 7 | 8 9 ...
    pool block     7    |    2    |   9

Attention gathers a sequence's blocks into one padded run of keys and masks what is past its
last position (padding rows point at whatever block sits in column 0 of the table, never read).
Both prefill (one sequence, T queries) and decode (B sequences, one query each) are described
by the same `AttnMeta`, so the attention layer has one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.cache.pools import Pools
from baton.errors import ConfigError, InvalidRequestError


@dataclass(frozen=True)
class AttnMeta:
    write_blocks: torch.Tensor
    """[n] pool block of each new token (n = T for prefill, B for decode)."""
    write_offsets: torch.Tensor
    """[n] offset inside that block."""
    read_blocks: torch.Tensor
    """[b, nb] blocks each sequence reads, in position order (padded)."""
    num_keys: int
    """Key rows kept from the gathered blocks (the rest of the last block is never valid)."""
    mask: torch.Tensor | None
    """[b, 1, q, num_keys] True where a query may see a key; None = plain causal from 0."""


@dataclass(frozen=True)
class StepContext:
    """What a layer needs besides its input: the pools and where this call reads/writes."""

    pools: Pools
    attn: AttnMeta | None
    slots: torch.Tensor | None
    """[b] Mamba state slot of each sequence (decode)."""
    slot: int = 0
    """The one sequence's Mamba state slot (prefill)."""
    fresh: bool = False
    """Prefill from position 0: Mamba layers start from zeros, not the slot's content."""

    def kv(self, layer: int) -> torch.Tensor:
        """[num_blocks, 2, tpb, kv_heads, head_dim] of global attention layer `layer`."""
        return self.pools.kv[_local(self.pools.spec.attn_index, layer, "KV")]

    def conv(self, layer: int) -> torch.Tensor:
        return self.pools.conv[_local(self.pools.spec.mamba_index, layer, "Mamba state")]

    def ssm(self, layer: int) -> torch.Tensor:
        return self.pools.ssm[_local(self.pools.spec.mamba_index, layer, "Mamba state")]


def _local(index: dict[int, int], layer: int, what: str) -> int:
    if layer not in index:
        raise ConfigError(
            f"layer {layer} is not in this stage's {what} pool (holds layers {sorted(index)}); "
            f"build the pools with PoolSpec.for_model over every layer the model runs"
        )
    return index[layer]


def prefill_meta(start_pos: int, T: int, block_table: list[int], pools: Pools) -> AttnMeta:
    """T queries at start_pos.. of one sequence; keys are its positions 0..start_pos+T-1."""
    tpb = pools.spec.tokens_per_block
    end = start_pos + T
    nb = -(-end // tpb)
    _check_table(block_table, nb, end, pools)
    dev = pools.kv.device
    table = torch.tensor(block_table[:nb], dtype=torch.long, device=dev)
    pos = torch.arange(start_pos, end, device=dev)
    # From position 0 the mask is the plain causal one, which SDPA's fused kernels do natively.
    mask = None
    if start_pos:
        mask = (torch.arange(end, device=dev)[None, :] <= pos[:, None])[None, None]
    return AttnMeta(table[pos // tpb], pos % tpb, table[None], end, mask)


def decode_meta(positions: torch.Tensor, block_tables: list[list[int]], pools: Pools) -> AttnMeta:
    """One query per sequence at positions[i]; tables are padded to the longest one needed."""
    tpb = pools.spec.tokens_per_block
    pos_list = positions.tolist()
    need = [p // tpb + 1 for p in pos_list]
    nb = max(need)
    for bt, n, p in zip(block_tables, need, pos_list, strict=True):
        _check_table(bt, n, p + 1, pools)
    rows = [bt[:n] + [bt[0]] * (nb - n) for bt, n in zip(block_tables, need, strict=False)]
    dev = pools.kv.device
    table = torch.tensor(rows, dtype=torch.long, device=dev)
    pos = positions.to(dev)
    cols = (pos // tpb)[:, None]
    write_blocks = table.gather(1, cols)[:, 0]
    keys = torch.arange(nb * tpb, device=dev)
    mask = (keys[None, :] <= pos[:, None])[:, None, None, :]
    return AttnMeta(write_blocks, pos % tpb, table, nb * tpb, mask)


def _check_table(block_table: list[int], need: int, length: int, pools: Pools) -> None:
    if len(block_table) < need:
        raise InvalidRequestError(
            f"block table has {len(block_table)} blocks but {length} tokens need {need} "
            f"blocks of {pools.spec.tokens_per_block}: allocate more blocks before the call"
        )
