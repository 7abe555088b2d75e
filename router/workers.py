"""Plain values describing workers: identity, load, snapshot events, the policy's view."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class WorkerLoad:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    free_slots: int = 0
    total_blocks: int = 0
    total_slots: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker registers with."""

    worker_id: str
    role: Role
    address: str
    tokens_per_block: int = 16
    load: WorkerLoad = WorkerLoad()


@dataclass(frozen=True)
class SnapshotEvent:
    """A snapshot inserted into or evicted from a worker; keys from router/prefix_hash.py."""

    inserted: bool
    block_hash: int
    snapshot_hash: int
    num_tokens: int


@dataclass(frozen=True)
class WorkerView:
    """A worker as a routing policy sees it at decision time."""

    worker_id: str
    role: Role
    address: str
    tokens_per_block: int
    load: WorkerLoad
    inflight: int
    """Requests this router has in flight on the worker."""
    seconds_since_heartbeat: float = 0.0

    @property
    def busy(self) -> int:
        """Requests the worker has, counting routed ones its heartbeat has not shown yet."""
        return max(self.load.running + self.load.waiting, self.inflight)

    def load_key(self) -> tuple[int, int, str]:
        """Sort key, least loaded first: busy, then more free blocks, then id (stable ties)."""
        return (self.busy, -self.load.free_blocks, self.worker_id)
