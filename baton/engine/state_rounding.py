"""Rounding a request's live recurrent state at its policy points (docs/state-precision.md).

The live state stays in the pools' float32. At every point of the snapshot policy
(`baton.cache.policy.snapshot_points`: a function of the prompt length and the policy, not
of what the cache holds, so also with reuse off) and at the decode end, it is replaced in
place by its value rounded to the configured 16-bit dtype, whether or not a snapshot is kept
there. A snapshot copies that value, and a restore gives back exactly the state the
uninterrupted run had there: reuse on equals reuse off bit for bit.

Stochastic draws are keyed by (seed, prefix hash, position, global layer, tensor, element)
(`baton.cache.rounding`), never by slot or batch. Single-process engines only so far: the
prefill worker's layer streams send before the chunk is committed, and PP stages / TP ranks
would have to mirror the rounding (the engine builder refuses those).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from baton.cache.policy import snapshot_points
from baton.cache.rounding import round_state, stream_key
from baton.cache.state_format import StateFormat
from baton.contract.prefix_hash import snapshot_key


class LiveRounding:
    def __init__(self, fmt: StateFormat, pools, policy, tokens_per_block: int):
        self.fmt, self.pools, self.policy, self.tpb = fmt, pools, policy, tokens_per_block
        self.tensors = [n for n, dt in fmt.dtypes.items()
                        if dt.itemsize < pools.state[n].dtype.itemsize]
        """The state tensors whose stored dtype is narrower than the pools' (the rest keep
        every bit)."""
        self.layers = list(pools.spec.state_layers)

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
        if layers is None:
            local, glob = slice(None), self.layers
        else:
            idx = self.pools.spec.state_index
            glob = [g for g in layers if g in idx]
            if not glob:
                return
            local = torch.tensor([idx[g] for g in glob])
        p = len(tokens)
        prefix = snapshot_key(list(tokens), p, self.tpb).snapshot_hash
        for name in self.tensors:
            pool = self.pools.state[name]  # [layers, slots, *shape]
            keys = torch.tensor([stream_key(self.fmt.seed, prefix, p, g, name)
                                 for g in glob], device=pool.device)
            live = pool[local, slot].to(torch.float32)
            pool[local, slot] = round_state(live, self.fmt.dtypes[name], self.fmt.rounding,
                                            keys).to(pool.dtype)


def live_rounding(cache_cfg, cache, model_dtype: torch.dtype) -> LiveRounding | None:
    """The engine's rounding, or None when every state tensor keeps the pools' dtype."""
    from baton.cache.state_format import resolve

    pools = cache.pools
    if not pools.has_state:
        return None
    fmt = resolve(cache_cfg, pools.spec.state_tensors, model_dtype, str(pools.spec.device))
    r = LiveRounding(fmt, pools, cache_cfg.mamba_state_config, pools.spec.tokens_per_block)
    return r if r.tensors else None
