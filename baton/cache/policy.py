"""Where a prompt's Mamba state is snapshotted: the snapshot points of a prompt length.

    prompt  |----|----|----|----|----|--     L = 150, interval 64,
            0   32   64   96  128      150   from_start [128, 999], from_end [0, 22, 999]
    points            ^64      ^128   ^150   (128 from periodic, start and end L-22; 999 out)

The engine ends a prefill chunk exactly at every point (the live state exists only at
chunk ends) and the manager commits a snapshot only there.
"""

from __future__ import annotations

from baton.config.cache import MambaStateConfig


def snapshot_points(policy: MambaStateConfig, prompt_len: int) -> list[int]:
    """Sorted, de-duplicated snapshot points in (0, prompt_len] for a prompt of that length."""
    if prompt_len <= 0:
        return []
    if policy.per_conversation:
        return [prompt_len]  # the turn boundary; periodic and offsets are off
    points: set[int] = set()
    step = policy.periodic_snapshot_interval
    if step:
        points.update(range(step, prompt_len + 1, step))
    points.update(o for o in policy.additional_snapshot_offsets_from_start if o <= prompt_len)
    points.update(
        prompt_len - o for o in policy.additional_snapshot_offsets_from_end if prompt_len - o > 0
    )
    return sorted(points)
