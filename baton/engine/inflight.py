"""In-flight prefix sharing: hold a request back while a running one is about to snapshot
the prefix they share (e.g. sessions starting together on one system prompt).

Without this, requests admitted in the same step all compute the shared prefix: the
snapshot that would serve them exists only once the first one's chunk ends there.
"""

from __future__ import annotations

from collections.abc import Iterable

from baton.engine.request import Phase, Request


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix (binary search over C-speed slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def waits_for_snapshot(req: Request, running: Iterable[Request]) -> bool:
    """True when a running prefill will commit a snapshot inside `req`'s reusable prefix."""
    for r in running:
        if r.phase is not Phase.PREFILL:
            continue
        pending = [p for p in r.snapshot_points if p > r.num_computed]
        if not pending:
            continue
        # a match never covers the last prompt token, so only points below it help
        limit = min(shared_prefix(req.prompt_ids, r.prompt_ids), req.prompt_len - 1)
        if pending[0] <= limit:
            return True
    return False
