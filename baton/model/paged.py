"""Per-call views of the paged pools: where each new token's K/V goes, what each query reads.

A sequence's position p lives in block `block_table[p // tpb]` at offset `p % tpb`:

    block_table = [7, 2, 9]   tpb = 4
    positions   0 1 2 3 | 4 5 6 7 | 8 9 ...
    pool block     7    |    2    |   9

The layers address one layer's pool through flat views (the layout itself is fixed by
`baton.model.pools`):

    kv[block, kv, token, kv_head, head_dim]
      as token rows   [block*2*tpb + kv*tpb + token, kv_head*head_dim]   (writes)
      as head rows    [(block*2*tpb + kv*tpb + token)*kv_heads + kv_head, head_dim]   (reads)

Reads gather head rows with one `index_select` straight into [2, b, kv_heads, keys, head_dim],
the layout attention multiplies against, so no padded block copy or reshape copy is made.
Both prefill (T queries per sequence) and decode (one query each) are described by the same
`AttnMeta`.

KV formats (`cache.kv_dtype`, docs/state-precision.md): float32 and bfloat16 pools hold the
values; a float8_e4m3 pool's (token, kv head) row is [head_dim fp8 values | float32 scale]
(head_dim + 4 bytes), so a token's bytes depend on that token alone, and a TP shard of heads
takes its scales along. `store_kv` writes every format (fp8: `quantize_fp8`, round to nearest
even, scale = max|x| / 448), `gather_kv` reads rows back as stored, `dequantize` widens them to
float32 (value * scale, one rounding): the attention kernels compute the same from the stored
rows tile by tile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.errors import ConfigError, InvalidRequestError
from baton.model.pools import FP8, Pools

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value: a row's largest |x| is stored as it."""


@dataclass(frozen=True)
class AttnMeta:
    write_rows: torch.Tensor
    """[n] token row of each new token's K (its V row is `tpb` further); n = all new tokens."""
    read_rows: torch.Tensor | None
    """[2*b*kv_heads*num_keys] head rows to gather: all K rows, then all V rows (None in a
    `decode_meta(lean=True)`, whose layers read through `tables`)."""
    num_keys: int
    """Keys each sequence reads (padded to the longest in a batch)."""
    mask: torch.Tensor | None
    """Additive float, 0 or -inf: [b, 1, q, num_keys] (prefill) or [b, 1, num_keys] (decode);
    None = plain causal from position 0. Built once per call, not converted in every layer
    (SDPA turns a bool mask into exactly this float one, per call)."""
    positions: torch.Tensor | None = None
    """Position of each new token, for rotary embeddings: long [n, T] (prefill), [b] (decode)."""
    tables: torch.Tensor | None = None
    """Decode: long [b, nb] block table of each sequence (what the fast path's attention
    kernel reads keys through; padded with its column 0)."""
    lens: torch.Tensor | None = None
    """Decode: long [b] keys each sequence reads (its position + 1)."""
    keys: torch.Tensor | None = None
    """A tree verify pass on the kernel: long [b, >= lens] the storage position of each key
    a row reads (its prompt, then its path's rows; its own last), None: 0..lens-1."""
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    """What the call's layers compute alike from the above, by the first that needs it (the
    rotary tables of the positions), so the other layers reuse the same tensors."""


@dataclass(frozen=True)
class StepContext:
    """What a layer needs besides its input: the pools and where this call reads/writes."""

    pools: Pools
    attn: AttnMeta | None
    slots: torch.Tensor | None
    """[b] recurrent state slot of each sequence."""
    slot_range: slice | None = None
    """`slots` as a slice when they are consecutive, so layers update the pool in place."""
    fresh: tuple[bool, ...] = ()
    """Per sequence (prefill): starts at position 0, so recurrent layers start from zeros."""

    def kv(self, layer: int) -> torch.Tensor:
        """[num_blocks, 2, tpb, kv_heads, head_dim] of global attention layer `layer`."""
        return self.pools.kv[_local(self.pools.spec.attn_index, layer, "KV")]

    def state(self, layer: int, name: str) -> torch.Tensor:
        """[num_slots, *shape] of state tensor `name` (as the config declares it) of global
        state layer `layer`."""
        return self.pools.state[name][_local(self.pools.spec.state_index, layer, "state")]


def slot_context(pools: Pools, attn: AttnMeta | None, slots: list[int] | torch.Tensor,
                 fresh=()) -> StepContext:
    """A context for sequences in state slots `slots` (in batch order). A tensor is taken
    as it is, without reading it on the host (so without the consecutive-slots slice)."""
    if isinstance(slots, torch.Tensor):
        return StepContext(pools, attn, slots, None, tuple(fresh))
    dev = pools.kv.device
    rng = None
    if slots and slots == list(range(slots[0], slots[0] + len(slots))):
        rng = slice(slots[0], slots[0] + len(slots))
    idx = torch.tensor(slots, dtype=torch.long, device=dev)
    return StepContext(pools, attn, idx, rng, tuple(fresh))


def _local(index: dict[int, int], layer: int, what: str) -> int:
    if layer not in index:
        raise ConfigError(
            f"layer {layer} is not in this stage's {what} pool (holds layers {sorted(index)}); "
            f"build the pools with PoolSpec.for_model over every layer the model runs"
        )
    return index[layer]


def prefill_meta(
    starts: list[int], T: int, block_tables: list[list[int]], pools: Pools
) -> AttnMeta:
    """T queries of each sequence i at starts[i]..; its keys are positions 0..starts[i]+T-1."""
    ends = [s + T for s in starts]
    tables = _tables(block_tables, ends, pools)
    dev = tables.device
    pos = torch.arange(T, device=dev)[None, :] + torch.tensor(starts, device=dev)[:, None]
    num_keys = max(ends)
    mask = None
    # From position 0 (all sequences) the mask is the plain causal one, which SDPA does natively.
    if any(starts):
        keys = torch.arange(num_keys, device=dev)
        hidden = (keys[None, None, :] > pos[:, :, None])[:, None]
        mask = torch.zeros(hidden.shape, device=dev, dtype=pools.spec.dtype)
        mask.masked_fill_(hidden, float("-inf"))
    return AttnMeta(_write_rows(tables, pos, pools), _read_rows(tables, num_keys, pools),
                    num_keys, mask, pos)


def decode_meta(positions: torch.Tensor, block_tables: list[list[int]] | torch.Tensor,
                pools: Pools, lean: bool = False, static: bool = False) -> AttnMeta:
    """One query per sequence at positions[i]; keys are padded to the longest sequence.
    `block_tables`: lists, or the [b, nb] tensor `_tables` would build from them (each row cut
    to the blocks its length needs, padded with its column 0; not checked again here).
    `lean`: every attention layer of the call reads K/V through `tables` and `lens` (the fast
    path's kernel, `fused.kernel_attention`), so the gather rows and the mask are not built.
    `static` (a table tensor): keys padded to the table's width (nb x tokens_per_block), so
    the shapes follow the tensors' and the positions are not read on the host."""
    if static:
        tables, num_keys = block_tables, block_tables.shape[1] * pools.spec.tokens_per_block
    elif isinstance(block_tables, torch.Tensor):  # [b, nb] as `_tables` builds (DecodeBatch)
        tables, num_keys = block_tables, int(positions.max()) + 1
    else:
        pos_list = positions.tolist()
        tables = _tables(block_tables, [p + 1 for p in pos_list], pools)
        num_keys = max(pos_list) + 1
        if lean:  # `_write_rows`' values from the lists: one tensor, no tensor ops
            tpb, dev = pools.spec.tokens_per_block, tables.device
            write_rows = torch.tensor([bt[p // tpb] * (2 * tpb) + p % tpb for bt, p in
                                       zip(block_tables, pos_list, strict=True)],
                                      dtype=torch.long, device=dev)
            pos = positions.to(dev)
            return AttnMeta(write_rows, None, num_keys, None, pos, tables, pos + 1)
    dev = tables.device
    pos = positions.to(dev)
    write_rows = _write_rows(tables, pos[:, None], pools)
    if lean:
        return AttnMeta(write_rows, None, num_keys, None, pos, tables, pos + 1)
    keys = torch.arange(num_keys, device=dev)
    mask = torch.zeros(pos.shape[0], 1, num_keys, device=dev, dtype=pools.spec.dtype)
    mask.masked_fill_(keys[None, None, :] > pos[:, None, None], float("-inf"))
    return AttnMeta(write_rows, _read_rows(tables, num_keys, pools), num_keys, mask, pos, tables,
                    pos + 1)


def _tables(block_tables: list[list[int]], lengths: list[int], pools: Pools) -> torch.Tensor:
    """[b, nb] block tables, each cut to what its length needs and padded with its column 0
    (padding is only read as masked keys)."""
    tpb = pools.spec.tokens_per_block
    need = [-(-n // tpb) for n in lengths]
    for bt, n, length in zip(block_tables, need, lengths, strict=True):
        _check_table(bt, n, length, pools)
    nb = max(need)
    rows = [bt[:n] + [bt[0]] * (nb - n) for bt, n in zip(block_tables, need, strict=True)]
    return torch.tensor(rows, dtype=torch.long, device=pools.kv.device)


def _write_rows(tables: torch.Tensor, pos: torch.Tensor, pools: Pools) -> torch.Tensor:
    """Token rows of positions pos [b, q] (sequence i's table is tables[i])."""
    tpb = pools.spec.tokens_per_block
    blocks = tables.gather(1, pos // tpb)
    return (blocks * (2 * tpb) + pos % tpb).reshape(-1)


def _read_rows(tables: torch.Tensor, num_keys: int, pools: Pools) -> torch.Tensor:
    """Head rows of keys 0..num_keys-1 of each sequence: [2 (K, V), b, kv_heads, num_keys]."""
    tpb, kvh = pools.spec.tokens_per_block, pools.spec.num_kv_heads
    keys = torch.arange(num_keys, device=tables.device)
    tok = tables[:, keys // tpb] * (2 * tpb) + keys % tpb  # [b, num_keys] K token rows
    heads = torch.arange(kvh, device=tables.device)[None, :, None]
    k_rows = tok[:, None, :] * kvh + heads
    return torch.stack([k_rows, k_rows + tpb * kvh]).reshape(-1)


def _check_table(block_table: list[int], need: int, length: int, pools: Pools) -> None:
    if len(block_table) < need:
        raise InvalidRequestError(
            f"block table has {len(block_table)} blocks but {length} tokens need {need} "
            f"blocks of {pools.spec.tokens_per_block}: allocate more blocks before the call"
        )


def quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """Rows x [..., hd] (any float dtype) as fp8 rows uint8 [..., hd + 4]: hd float8_e4m3fn
    values (round to nearest even) then the row's float32 scale max|x| / 448 (1 for a zero
    row). Element-wise but for the row's max, so a row's bytes depend on that row alone."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    vals = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat([vals.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Stored KV rows [..., row] (fp8 rows as uint8 or float8, or float rows) as float32
    [..., head_dim]: fp8 value * its row's scale."""
    if rows.dtype in (torch.uint8, FP8):
        rows = rows.view(torch.uint8)
        scale = rows[..., head_dim:].contiguous().view(torch.float32)
        return rows[..., :head_dim].view(FP8).float() * scale
    return rows.float()


def kv_token_rows(pool: torch.Tensor) -> torch.Tensor:
    """One layer's pool [blocks, 2, tpb, kvh, row] as token rows [blocks*2*tpb, kvh*row]
    (fp8 pools as bytes)."""
    if pool.dtype == FP8:
        pool = pool.view(torch.uint8)
    return pool.view(-1, pool.shape[3] * pool.shape[4])


def stored_rows(pool: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [n, kvh, hd] (or [n, kvh * hd]) as `pool` stores it: [n, kvh * row]."""
    kvh = pool.shape[3]
    n = x.shape[0]
    if pool.dtype == FP8:
        return quantize_fp8(x.reshape(n, kvh, -1)).reshape(n, -1)
    return x.reshape(n, -1).to(pool.dtype)


def store_kv(pool: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write tokens' k, v [n, kvh, hd] (or [n, kvh * hd]) at token rows `rows` [n] (K; V is
    tpb rows on) of one layer's pool, in its format."""
    tpb, tokens = pool.shape[2], kv_token_rows(pool)
    tokens.index_copy_(0, rows, stored_rows(pool, k))
    tokens.index_copy_(0, rows + tpb, stored_rows(pool, v))


def gather_kv(pool: torch.Tensor, read_rows: torch.Tensor) -> torch.Tensor:
    """Head rows `read_rows` of one layer's pool as stored: [len(read_rows), row] (fp8 rows
    as bytes)."""
    if pool.dtype == FP8:
        pool = pool.view(torch.uint8)
    return pool.view(-1, pool.shape[-1]).index_select(0, read_rows)
