"""The routing policy interface: pick one prefill and one decode worker per request.

Primitives a policy implements:
  choose(request, prefill, decode) -> RouteChoice
      `prefill` / `decode` are the live candidates (non-empty, sorted by worker id, workers
      that already failed this request removed). Must be deterministic given its state.
  observe(worker_id, events)   snapshot inserted/evicted events from heartbeats (default: ignore)
  forget(worker_id)            the worker left (ejected, deregistered, re-registered)
  tracked_snapshots(worker_id) how many snapshots it tracks for the worker (default 0)
Policies are called from many request threads at once and lock their own state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from baton.config.router import RouterConfig
from baton.contract import SnapshotEvent, WorkerView


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    session_id: str = ""


class RouteChoice(NamedTuple):
    prefill: WorkerView
    decode: WorkerView


class RoutingPolicy(ABC):
    def __init__(self, config: RouterConfig):
        self.config = config

    @abstractmethod
    def choose(
        self, request: RouteRequest, prefill: Sequence[WorkerView], decode: Sequence[WorkerView]
    ) -> RouteChoice: ...

    def observe(self, worker_id: str, events: Sequence[SnapshotEvent]) -> None:
        """Snapshot events of a worker, oldest first."""
        return None

    def forget(self, worker_id: str) -> None:
        """Drop anything kept about the worker."""
        return None

    def tracked_snapshots(self, worker_id: str) -> int:
        """Snapshots the policy tracks for the worker (for ListWorkers)."""
        return 0


def least_loaded(candidates: Sequence[WorkerView]) -> WorkerView:
    return min(candidates, key=WorkerView.load_key)
