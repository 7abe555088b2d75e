"""Test-only canaries in free memory (`BATON_TEST_CANARIES=1` in a worker's environment).

Armed, the cache manager writes CANARY into every element of each KV block and state slot
when it becomes free (and into every free one at start), on every pipeline stage (the write
is a mirrored operation). An audit then reads the free ones back: any that no longer holds
CANARY took a stray write (a transfer outside its reservation, a late write after the
reservation was given up), which nothing else would notice until a later request read
garbage. Off by default: the fills cost a memset per freed block.
"""

from __future__ import annotations

import torch

from baton import envs
from baton.model.pools import FP8, FP8_FILL

ENV = envs.TEST_CANARIES.name
CANARY = 12288
"""Exact in float32, bfloat16 and float16 (1.5 * 2**13), and never a plausible KV value."""


def wanted() -> bool:
    return envs.TEST_CANARIES.get()


def bad_blocks(pools, ids: list[int]) -> list[int]:
    """Those of `ids` (free KV blocks) whose bytes are not all CANARY on these pools."""
    if not pools.has_kv or not ids:
        return []
    idx = torch.tensor(ids, dtype=torch.long)
    kv, want = pools.kv, CANARY
    if kv.dtype == FP8:  # rows of values and scales: `fill_block` wrote bytes
        kv, want = kv.view(torch.uint8), FP8_FILL
    ok = (kv.index_select(1, idx) == want).transpose(0, 1).flatten(1).all(dim=1)
    return [b for b, good in zip(ids, ok.tolist(), strict=True) if not good]


def bad_slots(pools, ids: list[int]) -> list[int]:
    """Those of `ids` (free state slots) of which any state tensor is not all CANARY."""
    if not pools.has_state or not ids:
        return []
    # live and snapshot slots (their own 16-bit pool when split, PoolSpec.snapshot_slots)
    return [s for s in ids if not all(bool((pools.slot(n, s) == CANARY).all())
                                      for n in pools.state)]
