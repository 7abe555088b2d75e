"""Continuous batching: which requests prefill (and up to where) and which decode this step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from baton.cache.manager import HybridCacheManager
from baton.config import WorkerConfig
from baton.engine.inflight import waits_for_snapshot
from baton.engine.request import Phase, Request
from baton.errors import CapacityError


@dataclass
class StepPlan:
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    """(request, chunk end): compute prompt tokens [num_computed, end)."""
    decodes: list[Request] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    """Admits waiting requests while their worst-case blocks fit, then plans one step.

    Admission reserves every block a request may ever need (prompt + max_tokens), so a
    running request never has to be preempted for lack of blocks.
    """

    def __init__(self, cfg: WorkerConfig, cache: HybridCacheManager, max_model_len: int):
        self.cfg = cfg
        self.cache = cache
        self.max_model_len = max_model_len
        self.tpb = cache.pools.spec.tokens_per_block
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._rejected: list[tuple[Request, str]] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def blocks_needed(self, req: Request) -> int:
        total = min(req.prompt_len + req.sampling.max_tokens, self.max_model_len)
        return -(-total // self.tpb) if self.cache.pools.has_kv else 0

    def outstanding_blocks(self) -> int:
        """Blocks running requests may still allocate."""
        if not self.cache.pools.has_kv:
            return 0
        return sum(
            max(0, self.blocks_needed(r) - len(self.cache.block_table(r.id))) for r in self.running
        )

    def take_rejected(self) -> list[tuple[Request, str]]:
        """Requests dropped from `waiting` because the pools can never hold them, with why."""
        out, self._rejected = self._rejected, []
        return out

    def schedule(self) -> StepPlan:
        self._admit()
        plan = StepPlan()
        budget = self.cfg.max_batch_tokens
        for req in self.running:
            if req.phase is Phase.DECODE:
                plan.decodes.append(req)
            elif req.phase is Phase.PREFILL and budget > 0:
                end = req.next_chunk_end(min(self.cfg.prefill_chunk_size, budget))
                budget -= end - req.num_computed
                plan.prefills.append((req, end))
        return plan

    def _admit(self) -> None:
        deferred: list[Request] = []
        try:
            self._admit_ready(deferred)
        finally:
            self.waiting.extendleft(reversed(deferred))

    def _admit_ready(self, deferred: list[Request]) -> None:
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if self.cache.reuse_enabled and waits_for_snapshot(req, self.running):
                deferred.append(self.waiting.popleft())
                continue
            need = self.blocks_needed(req)
            if need and not self.cache.can_allocate(self.outstanding_blocks() + need):
                if not self.running:  # nothing will free more: this request can never start
                    self._reject(f"request {req.id} needs {need} KV blocks but the pool cannot "
                                 "free that many; raise cache.num_blocks or lower max_tokens")
                    continue
                return
            try:
                adm = self.cache.admit(req.id, req.prompt_ids, req.session)
            except CapacityError as e:
                if not self.running:
                    self._reject(str(e))
                    continue
                return
            self.waiting.popleft()
            req.cached_tokens = req.num_computed = adm.cached_tokens
            req.snapshot_points = tuple(adm.snapshot_points)
            req.phase = Phase.PREFILL
            req.holds_cache = True
            self.running.append(req)

    def _reject(self, why: str) -> None:
        self._rejected.append((self.waiting.popleft(), why))
