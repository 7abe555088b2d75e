"""Rounding a request's live recurrent state at its policy points (docs/state-precision.md).

The live state stays in the pools' float32. At every point of the snapshot policy
(`baton.cache.policy.snapshot_points`: a function of the prompt length and the policy, not
of what the cache holds, so also with reuse off) and at the decode end, it is replaced in
place by its value rounded to the configured 16-bit dtype, whether or not a snapshot is kept
there. A snapshot copies that value, and a restore gives back exactly the state the
uninterrupted run had there: reuse on equals reuse off bit for bit.

Stochastic draws are keyed by (seed, prefix hash, position, global layer, tensor, element)
(`baton.cache.rounding`), never by slot or batch. Under pipeline or tensor parallelism the
cache manager's process rounds the layers it holds and records the rounding as a mirrored
pool operation ("round", slot, [prefix hash, position, layers]); every other stage / rank
applies it to its own layers before its next forward (`apply`). A tensor-parallel rank
numbers its shard's elements as in the whole (TP 1) tensor (`tp1_index`), so TP n rounds
every element as TP 1 does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from baton.cache.policy import snapshot_points
from baton.cache.rounding import round_state, stream_key
from baton.cache.state_format import StateFormat
from baton.contract.prefix_hash import snapshot_key


class LiveRounding:
    def __init__(self, fmt: StateFormat, pools, policy, tokens_per_block: int,
                 index: dict[str, torch.Tensor] | None = None):
        """`pools`: the engine's (mirrored under PP / TP: the local tensors are rounded, the
        operation recorded for the others) or a stage's / rank's own. `index`: by tensor,
        the TP 1 flat index of each element of this rank's shard (None: TP 1)."""
        self.fmt, self.pools, self.policy, self.tpb = fmt, pools, policy, tokens_per_block
        self.local = getattr(pools, "local", pools)
        """The tensors this process holds (a stage's layers, a rank's shard)."""
        self.index = index or {}
        live = {t.name: pools.spec.state_dtype(t) for t in pools.spec.state_tensors}
        self.tensors = [n for n, dt in fmt.dtypes.items() if dt.itemsize < live[n].itemsize]
        """The state tensors whose stored dtype is narrower than the pools' (the rest keep
        every bit)."""
        self.layers = list(self.local.spec.state_layers)

    def points(self, prompt_len: int) -> tuple[int, ...]:
        """Prompt positions where the live state is rounded (chunks must end there)."""
        return tuple(snapshot_points(self.policy, prompt_len))

    @property
    def at_decode_end(self) -> bool:
        return self.policy.decode_end_snapshot

    def round(self, slot: int, tokens: Sequence[int], layers: Sequence[int] | None = None
              ) -> None:
        """Round slot `slot`'s state, which holds the state after `tokens`, in place: every
        state layer, or only global `layers` (a layer handed to a layer stream). Rounding a
        value already rounded leaves it as it is, so a layer may be rounded twice."""
        p = len(tokens)
        prefix = snapshot_key(list(tokens), p, self.tpb).snapshot_hash
        ops = getattr(self.pools, "ops", None)
        if ops is not None:  # the other stages / ranks round their layers alike
            ops.append(("round", slot, [prefix, p, list(layers) if layers is not None else []]))
        self.apply(slot, [prefix, p, list(layers) if layers is not None else []])

    def apply(self, slot: int, key: list) -> None:
        """Round this process's layers of `slot` under `key` = [prefix hash, position,
        global layers (empty: all)]."""
        prefix, p, layers = key
        if not layers:
            local, glob = slice(None), self.layers
        else:
            idx = self.local.spec.state_index
            glob = [g for g in layers if g in idx]
            if not glob:
                return
            local = torch.tensor([idx[g] for g in glob])
        for name in self.tensors:
            pool = self.local.state[name]  # [layers, slots, *shape]
            keys = torch.tensor([stream_key(self.fmt.seed, prefix, p, g, name)
                                 for g in glob], device=pool.device)
            live = pool[local, slot].to(torch.float32)
            pool[local, slot] = round_state(live, self.fmt.dtypes[name], self.fmt.rounding,
                                            keys, self.index.get(name)).to(pool.dtype)


def tp1_index(spec, tp: int, rank: int) -> torch.Tensor:
    """The flat index, in the whole (TP 1) tensor of `spec` (a `StateTensorSpec`), of every
    element of rank `rank`'s shard at TP `tp`, shaped as the shard (baton/model/tp_shard.py:
    each section sliced on its own along the shard axis, held units in order)."""
    from baton.model.tp_shard import state_shard

    sh = state_shard(spec, tp, 4)
    axis, along, start = sh.shard_axis, [], 0
    for i, sec in enumerate(sh.sections):
        lo, hi = sh.held(i, rank)
        along.extend(range(start + lo * sec.unit_width, start + hi * sec.unit_width))
        start += sec.units * sec.unit_width
    whole = torch.arange(int(torch.tensor(spec.shape).prod()), dtype=torch.int64)
    return whole.view(tuple(spec.shape)).index_select(axis, torch.tensor(along)).contiguous()


def live_rounding(cache_cfg, pools, model_dtype: torch.dtype, device: str | None = None,
                  full_tensors=None, tp: int = 1, rank: int = 0) -> LiveRounding | None:
    """The rounding of `pools` (an engine's, a stage's or a rank's), or None when every
    state tensor keeps the pools' dtype. `full_tensors`: the whole model's state tensor
    specs, needed at TP > 1 (the pools then hold rank `rank`'s shards)."""
    from baton.cache.state_format import resolve

    if not pools.has_state:  # (mirrored pools: any stage's)
        return None
    full = tuple(full_tensors or pools.spec.state_tensors)
    fmt = resolve(cache_cfg, full, model_dtype, device or str(pools.spec.device))
    index = {t.name: tp1_index(t, tp, rank) for t in full} if tp > 1 else None
    r = LiveRounding(fmt, pools, cache_cfg.mamba_state_config, pools.spec.tokens_per_block,
                     index)
    return r if r.tensors else None


def split_snapshots(cfg, spec):
    """`spec` (an engine's, a stage's or a rank's) with its snapshot slots in a pool of the
    configured 16-bit state dtype when that is narrower than the live one
    (`PoolSpec.split_snapshots`): the live rows are one per running request, the pad row and
    speculation's rows; the rest of num_state_slots are snapshots. The same split on every
    stage and rank (it depends on the config alone)."""
    from baton.cache.state_format import resolve
    from baton.engine.speculative.setup import reserved_slots

    if not spec.state_layers:
        return spec
    reserved = reserved_slots(cfg.speculative, spec.num_slots, cfg.worker.max_num_seqs)
    fmt = resolve(cfg.cache, spec.state_tensors, spec.dtype, spec.device)
    return spec.split_snapshots(cfg.worker.max_num_seqs + 1 + reserved, fmt.dtypes)
