"""Admission at the router: request limits checked before any worker call, and the queue
requests wait in, in arrival order, while every decode worker is full.

    check_limits(prompt, sampling, workers)   INVALID_ARGUMENT for what no worker could take
    queue = AdmissionQueue(config)
    ticket = queue.arrive(request_id)          its place in arrival order
    queue.wait_turn(ticket, cancel)            at once, unless earlier requests are waiting
    queue.wait_for_capacity(ticket, cancel)    every worker was full: wait (head of the queue
                                               retries when a request ends, or every RETRY_S)
    queue.leave(ticket)                        started (or gave up): the next one goes
    queue.capacity_freed()                     a request on this router ended

RESOURCE_EXHAUSTED (CapacityError) when the queue already holds max_queued_requests or a
request waited queue_timeout_s; RequestCancelled when its client goes away meanwhile.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from baton.config.router import RouterConfig
from baton.contract import Role, SamplingParams, WorkerView
from baton.contract.limits import check_length, check_pool, check_samples
from baton.errors import CapacityError, RequestCancelled
from baton.sampling import MAX_SAMPLES
from router.cancellation import Cancellation

RETRY_S = 0.05
"""The head of the queue retries at least this often: capacity also frees on other routers."""


def check_limits(prompt: Sequence[int], sampling: SamplingParams,
                 workers: Sequence[WorkerView]) -> None:
    """Refuse what no registered worker can take, as their engines would (same messages)."""
    lens = [w.max_model_len for w in workers if w.max_model_len]
    if lens:
        check_length(len(prompt), sampling.max_tokens, min(lens))
    pools = [(w.load.total_blocks, w.tokens_per_block) for w in workers if w.load.total_blocks]
    if pools:
        blocks, tpb = min(pools)
        check_pool(len(prompt) + sampling.max_tokens, tpb, blocks)
    decode = [(w.load.total_blocks, w.tokens_per_block) for w in workers
              if w.load.total_blocks and w.role is Role.DECODE]  # where the samples live
    if decode and sampling.n > 1:
        blocks, tpb = min(decode)
        # their state slots are checked by the decode worker (worker.max_num_seqs)
        check_samples(sampling.n, len(prompt), sampling.max_tokens, min(lens, default=2**31),
                      MAX_SAMPLES, tpb, blocks)


@dataclass(order=True)
class Ticket:
    seq: int
    request_id: str = field(compare=False)
    joined: float | None = field(default=None, compare=False)
    """When it joined the waiting line (None: it has not waited yet)."""


class AdmissionQueue:
    def __init__(self, config: RouterConfig):
        self.max_queued = config.max_queued_requests
        self.timeout_s = config.queue_timeout_s
        self._cond = threading.Condition()
        self._waiting: list[Ticket] = []
        """Tickets waiting for capacity, in arrival order; the first one retries."""
        self._seq = itertools.count()
        self._freed = 0

    def arrive(self, request_id: str) -> Ticket:
        return Ticket(next(self._seq), request_id)

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def wait_turn(self, ticket: Ticket, cancel: Cancellation) -> None:
        """Returns at once when nobody waits; else queues behind the earlier arrivals and
        returns when this request heads the line (to try the workers)."""
        with self._cond:
            if not self._waiting:
                return
        self._wait(ticket, cancel, head_only=True)

    def wait_for_capacity(self, ticket: Ticket, cancel: Cancellation) -> None:
        """Every worker was full: wait until this request heads the line and capacity may
        have freed (a request on this router ended, or RETRY_S passed)."""
        self._wait(ticket, cancel, head_only=False)

    def leave(self, ticket: Ticket) -> None:
        with self._cond:
            self._remove(ticket)

    def capacity_freed(self) -> None:
        with self._cond:
            self._freed += 1
            self._cond.notify_all()

    # -- internals (condition held) --------------------------------------------------------

    def _join(self, ticket: Ticket) -> None:
        if len(self._waiting) >= self.max_queued:
            raise CapacityError(
                f"every decode worker is full and the router queue holds "
                f"{len(self._waiting)} requests (router.max_queued_requests="
                f"{self.max_queued}); retry later"
            )
        ticket.joined = time.monotonic()
        bisect.insort(self._waiting, ticket)

    def _wait(self, ticket: Ticket, cancel: Cancellation, head_only: bool) -> None:
        with cancel.hook(self._wake), self._cond:
            if ticket.joined is None:
                self._join(ticket)
            seen, head_since = self._freed, None
            while True:
                remaining = self._check(ticket, cancel)
                if self._waiting[0] is ticket:
                    now = time.monotonic()
                    head_since = now if head_since is None else head_since
                    if head_only or self._freed != seen or now - head_since >= RETRY_S:
                        return
                self._cond.wait(min(RETRY_S, remaining))

    def _check(self, ticket: Ticket, cancel: Cancellation) -> float:
        """Seconds left to wait; raises (leaving the line) on cancel or timeout."""
        if cancel.cancelled:
            self._remove(ticket)
            raise RequestCancelled(f"request {ticket.request_id} cancelled while queued")
        remaining = ticket.joined + self.timeout_s - time.monotonic()
        if remaining <= 0:
            self._remove(ticket)
            raise CapacityError(
                f"request {ticket.request_id} waited {self.timeout_s:g}s in the router queue "
                f"and every decode worker stayed full (router.queue_timeout_s); retry later "
                f"or add decode workers"
            )
        return remaining

    def _remove(self, ticket: Ticket) -> None:
        if ticket in self._waiting:
            self._waiting.remove(ticket)
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
