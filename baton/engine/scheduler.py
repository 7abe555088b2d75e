"""Continuous batching: which requests prefill (and up to where) and which decode this step.

Every running request in its decode phase decodes each step. Prefilling requests share the
step's `max_batch_tokens` in the order of the `worker.prefill_schedule` policy (looked up in
PREFILL_ORDERS); admission from the waiting queue is first come, first served.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from baton.cache.manager import HybridCacheManager
from baton.config import WorkerConfig
from baton.contract.limits import sample_blocks
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


PrefillOrder = Callable[[list[Request], float, float], list[Request]]
"""(prefilling requests in admission order, now, age bound in seconds) -> the order in which
they get the step's prompt-token budget."""


def fcfs(prefilling: list[Request], now: float, max_wait_s: float) -> list[Request]:
    """Admission order: a short increment waits behind every full prefill admitted before it."""
    return list(prefilling)


def fewest_uncached_first(
    prefilling: list[Request], now: float, max_wait_s: float
) -> list[Request]:
    """Requests that arrived `max_wait_s` ago or earlier first, oldest first (no request starves);
    then the others by prompt tokens still to compute, fewest first (ties: admission order).
    A prompt that is 95% cached then gets its first token before the full prefills around it."""
    overdue = [r for r in prefilling if now - r.arrival >= max_wait_s]
    fresh = [r for r in prefilling if now - r.arrival < max_wait_s]
    overdue.sort(key=lambda r: r.arrival)
    fresh.sort(key=lambda r: r.prompt_len - r.num_computed)
    return overdue + fresh


PREFILL_ORDERS: dict[str, PrefillOrder] = {
    "fcfs": fcfs,
    "fewest_uncached_first": fewest_uncached_first,
}


class Scheduler:
    """Admits waiting requests while their worst-case blocks fit, then plans one step.

    Admission reserves every block a request may ever need (prompt + max_tokens), so a
    running request never has to be preempted for lack of blocks. A decode worker's
    reservations (prompts arriving by transfer, `reserved`) count the same way.
    """

    def __init__(self, cfg: WorkerConfig, cache: HybridCacheManager, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.cache = cache
        self.max_model_len = max_model_len
        self.tpb = cache.pools.spec.tokens_per_block
        self.prefill_order = PREFILL_ORDERS[cfg.prefill_schedule]
        self.clock = clock
        """Time source for request ages (the clock of `Request.arrival`)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: list[Request] = []
        """Decode side: requests holding blocks for a prompt that arrives by transfer, not yet
        running (`Engine.reserve_remote` -> `start_reserved`)."""
        self._rejected: list[tuple[Request, str]] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def reserve(self, req: Request) -> None:
        self.reserved.append(req)

    def start_reserved(self, req: Request) -> None:
        self.reserved.remove(req)
        self.running.append(req)

    def remove(self, req: Request) -> None:
        for queue in (self.running, self.waiting, self.reserved):
            if req in queue:
                queue.remove(req)
                return

    def blocks_needed(self, req: Request) -> int:
        """Most blocks the request may hold (all its samples' when n > 1)."""
        if not self.cache.pools.has_kv:
            return 0
        return sample_blocks(req.forks, req.prompt_len, req.sampling.max_tokens, self.tpb,
                             self.max_model_len)

    def outstanding_blocks(self) -> int:
        """Blocks running and reserved requests may still allocate (a reservation holds its
        prompt's blocks; its answer's come once it runs)."""
        if not self.cache.pools.has_kv:
            return 0
        return sum(max(0, self.blocks_needed(r) - len(self.cache.block_table(r.id)))
                   for r in (*self.running, *self.reserved))

    def take_rejected(self) -> list[tuple[Request, str]]:
        """Requests dropped from `waiting` because the pools can never hold them, with why."""
        out, self._rejected = self._rejected, []
        return out

    def schedule(self) -> StepPlan:
        self._admit()
        plan = StepPlan(decodes=[r for r in self.running if r.phase is Phase.DECODE])
        prefilling = [r for r in self.running if r.phase is Phase.PREFILL]
        budget = self.cfg.max_batch_tokens
        for req in self.prefill_order(prefilling, self.clock(), self.cfg.prefill_max_wait_s):
            if budget <= 0:
                break
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
            # a prefix in a tier: its read is posted and the request waits ("restoring")
            # while the others step; admitted once the read is done
            if self.cache.restoring(req.id, req.prompt_ids,
                                    reuse=req.sampling.prompt_logprobs is None):
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
                # prompt logprobs need every position's logits: nothing is restored for them
                adm = self.cache.admit(req.id, req.prompt_ids, req.session,
                                       reuse=req.sampling.prompt_logprobs is None,
                                       samples=req.forks)
            except CapacityError as e:
                # live slots held outside `running` (a prefill handing off, a reservation
                # waiting for its transfer) are freed by release or lease expiry: wait for them
                if not self.running and not self.cache.live_requests():
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
