"""Which worker holds the deepest snapshot of a prompt, whatever the routing policy.

Conditional disaggregation asks it about decode workers. The prefix_aware policy already
indexes every worker's snapshot events, and is asked directly; any other policy ignores
events, so the locator keeps its own bounded index (router.prefix_tree_max_nodes), fed by
the registry like a policy. A hit is a hint: the worker's own match decides.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from baton.config.router import RouterConfig
from baton.contract import SnapshotEvent, WorkerView
from baton.contract.prefix_hash import snapshot_key
from router.prefix_index import PrefixIndex


class SnapshotLocator:
    def __init__(self, config: RouterConfig, policy=None):
        self._policy = policy if hasattr(policy, "matched_tokens") else None
        self._lock = threading.Lock()
        self.index = None if self._policy is not None else PrefixIndex(config.prefix_tree_max_nodes)

    @property
    def listens(self) -> bool:
        """Whether the registry must feed this locator (it has an index of its own)."""
        return self.index is not None

    def matched_tokens(self, tokens: Sequence[int],
                       candidates: Sequence[WorkerView]) -> dict[str, int]:
        """Per candidate, the prompt tokens its deepest reported snapshot covers (0: none)."""
        ids = {w.worker_id for w in candidates}
        if self._policy is not None:  # its index holds every worker's: keep the candidates'
            got = self._policy.matched_tokens(tokens, candidates)
            return {w: n for w, n in got.items() if w in ids}
        best: dict[str, int] = {}
        with self._lock:
            for tpb in sorted({w.tokens_per_block for w in candidates}):
                for worker_id, n in self.index.match(tokens, tpb).items():
                    if worker_id in ids:
                        best[worker_id] = max(best.get(worker_id, 0), n)
        return best

    def hint(self, worker: WorkerView, tokens: Sequence[int], num_tokens: int) -> None:
        """`worker` said (last Decode or Serve message) that it now holds a decode-end snapshot
        of `tokens[:num_tokens]`: index it now, so the conversation's next turn, which may
        arrive before the worker's next heartbeat, finds it. Heartbeats confirm or evict it."""
        if num_tokens <= 0 or num_tokens > len(tokens):
            return
        k = snapshot_key(tokens, num_tokens, worker.tokens_per_block)
        ev = [SnapshotEvent(True, k.block_hash, k.snapshot_hash, num_tokens)]
        if self._policy is not None:
            self._policy.observe(worker.worker_id, ev)
        else:
            self.observe(worker.worker_id, ev)

    def observe(self, worker_id: str, events: Sequence[SnapshotEvent]) -> None:
        with self._lock:  # snapshots to ship come out of a pool: tier entries do not count
            self.index.apply(worker_id, [e for e in events if not e.tier])

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self.index.remove_worker(worker_id)
