"""prefix_aware: send a prompt where a snapshot covers the longest part of it; load breaks ties.

Hybrid-aware: workers report Mamba snapshots (baton/contract/prefix_hash.py keys), never bare KV
blocks, so a matched prefix is always one the worker can resume from. Only workers within
`prefix_load_slack` requests of the least busy candidate compete on the cache, so one hot
prefix cannot pile every request onto one worker. Both roles are scored the same way
(decode workers that report snapshots, e.g. decode-end ones, attract the next turn).

Tier hits (snapshots a worker holds in its disk tier, events with tier 1) are kept in a second
index: the deepest match wins, and at equal depth a pool hit beats a tier hit, which beats none
(a tier hit is restored from disk before use: dearer than a pool hit, far cheaper than compute).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from baton.config.router import RouterConfig
from baton.contract import SnapshotEvent, WorkerView
from router.policies.base import RouteChoice, RouteRequest, RoutingPolicy
from router.prefix_index import PrefixIndex, prompt_block_hashes


class PrefixAwarePolicy(RoutingPolicy):
    def __init__(self, config: RouterConfig):
        super().__init__(config)
        self._lock = threading.Lock()
        self.index = PrefixIndex(config.prefix_tree_max_nodes)
        self.tier_index = PrefixIndex(config.prefix_tree_max_nodes)

    def choose(
        self, request: RouteRequest, prefill: Sequence[WorkerView], decode: Sequence[WorkerView]
    ) -> RouteChoice:
        tokens = request.prompt_ids
        hashes = {
            tpb: prompt_block_hashes(tokens, tpb)
            for tpb in {w.tokens_per_block for w in (*prefill, *decode)}
        }
        return RouteChoice(self._pick(tokens, prefill, hashes), self._pick(tokens, decode, hashes))

    def matched_tokens(
        self, tokens: Sequence[int], candidates: Sequence[WorkerView], hashes=None,
        tier: bool = False,
    ) -> dict[str, int]:
        """Per candidate worker, prompt tokens its deepest usable snapshot covers (`tier`
        True: in its disk tier)."""
        hashes = hashes or {}
        best: dict[str, int] = {}
        index = self.tier_index if tier else self.index
        with self._lock:
            for tpb in sorted({w.tokens_per_block for w in candidates}):
                for worker_id, n in index.match(tokens, tpb, hashes.get(tpb)).items():
                    best[worker_id] = max(best.get(worker_id, 0), n)
        return best

    def observe(self, worker_id: str, events: Sequence[SnapshotEvent]) -> None:
        with self._lock:
            self.index.apply(worker_id, [e for e in events if not e.tier])
            self.tier_index.apply(worker_id, [e for e in events if e.tier])

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self.index.remove_worker(worker_id)
            self.tier_index.remove_worker(worker_id)

    def tracked_snapshots(self, worker_id: str) -> int:
        with self._lock:
            return self.index.tracked(worker_id)

    def _pick(self, tokens, candidates: Sequence[WorkerView], hashes) -> WorkerView:
        floor = min(w.busy for w in candidates) + self.config.prefix_load_slack
        eligible = [w for w in candidates if w.busy <= floor]
        pool = self.matched_tokens(tokens, eligible, hashes)
        tier = self.matched_tokens(tokens, eligible, hashes, tier=True) if len(
            self.tier_index) else {}

        def key(w: WorkerView):
            p, t = pool.get(w.worker_id, 0), tier.get(w.worker_id, 0)
            return (-max(p, t), -p, *w.load_key())

        return min(eligible, key=key)
