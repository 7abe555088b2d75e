"""The oracle of tensor-parallel transfer tests, independent of the transfer plan.

A prefill stage's bytes are defined at TP 1: `whole_pools` fills the TP-1 pools of its layers
from a seed; rank r of TP t holds `shard` of them (the units `held_units` gives it, section
by section along each tensor's shard axis: the layout the TP model loader cuts weights by),
so replicated units (KV heads fewer than TP, Mamba2 B/C with n_groups 1) are the same bytes
on every rank. After a handoff, decode rank d of TP q must hold, in the reserved blocks and
slot, exactly `shard(whole, q, d)` of the source's blocks and slot, and its canary bytes
everywhere else: whatever the plan chose as each byte's writer.
"""

from __future__ import annotations

import torch

from baton.model.pools import Pools, PoolSpec
from baton.model.tp_shard import model_shards
from bench.harness.verify import Handoff

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers (index copies keep every bit, NaN payloads included)."""
    return t.view(_INT[t.element_size()])


def whole_pools(mc, layers, num_blocks: int, tokens_per_block: int, num_slots: int,
                seed: int, dtype=torch.float32) -> Pools:
    pools = Pools(PoolSpec.for_model(mc, num_blocks=num_blocks,
                                     tokens_per_block=tokens_per_block, num_slots=num_slots,
                                     layers=layers, dtype=dtype))
    g = torch.Generator().manual_seed(seed)
    for t in (pools.kv, *pools.state.values()):
        b = t.view(-1).view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return pools


def _index(shard, rank: int) -> torch.Tensor:
    """Global indices along the shard axis that `rank` holds, in its local order."""
    out, start = [], 0
    for i, sec in enumerate(shard.sections):
        lo, hi = shard.held(i, rank)
        out.append(torch.arange(start + lo * sec.unit_width, start + hi * sec.unit_width))
        start += sec.units * sec.unit_width
    return torch.cat(out)


def shard(whole: Pools, mc, size: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank` of TP `size`'s share of every pool tensor of `whole` (integer views)."""
    spec = whole.spec
    dtype = str(spec.dtype).removeprefix("torch.")
    out = {}
    for s in model_shards(mc, size, dtype, spec.tokens_per_block):
        t = whole.kv if s.name == "kv" else whole.state.get(s.name)
        if t is None or not t.numel():
            continue
        out[s.name] = _bits(t).index_select(s.shard_axis + 2, _index(s, rank))
    return out


def fill_shard(pools: Pools, mc, layers, seed: int, rank: int, size: int) -> None:
    """A prefill rank's pools: its shard of the seeded TP-1 pools of `layers`."""
    s = pools.spec
    whole = whole_pools(mc, layers, s.num_blocks, s.tokens_per_block, s.num_slots, seed,
                        s.dtype)
    for name, t in shard(whole, mc, size, rank).items():
        dst = pools.kv if name == "kv" else pools.state[name]
        _bits(dst).copy_(t)


def expected(dst: Pools, mc, rank: int, size: int, sources: list[Pools],
             handoffs: list[Handoff]) -> dict[str, bytes]:
    """Decode rank `rank` of TP `size` after the handoffs: `dst` (its bytes before) with,
    per global layer it holds, the source stage holding that layer's shard of each request's
    blocks and slot (`sources`: each prefill stage's TP-1 pools)."""
    out = {"kv": _bits(dst.kv).clone(), **{n: _bits(t).clone() for n, t in dst.state.items()}}
    parts = [(src, shard(src, mc, size, rank)) for src in sources]
    spec = dst.spec
    for h in handoffs:
        for g in spec.attn_layers:
            src, sh = next((p, s) for p, s in parts if g in p.spec.attn_index)
            sl, dl = src.spec.attn_index[g], spec.attn_index[g]
            for sb, db in zip(h.src_blocks[h.skip:], h.dst_blocks[h.skip:], strict=True):
                out["kv"][dl, db] = sh["kv"][sl, sb]
        for g in spec.mamba_layers:
            src, sh = next((p, s) for p, s in parts if g in p.spec.mamba_index)
            sl, dl = src.spec.mamba_index[g], spec.mamba_index[g]
            for name in dst.state:
                out[name][dl, h.dst_slot] = sh[name][sl, h.src_slot]
    return {k: v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for k, v in out.items()}
