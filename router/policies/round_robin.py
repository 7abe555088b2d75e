"""round_robin: each role cycles through its live workers in id order."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from baton.config.router import RouterConfig
from baton.contract import WorkerView
from router.policies.base import RouteChoice, RouteRequest, RoutingPolicy


class RoundRobinPolicy(RoutingPolicy):
    def __init__(self, config: RouterConfig):
        super().__init__(config)
        self._lock = threading.Lock()
        self._turn = 0

    def choose(
        self, request: RouteRequest, prefill: Sequence[WorkerView], decode: Sequence[WorkerView]
    ) -> RouteChoice:
        with self._lock:
            turn, self._turn = self._turn, self._turn + 1
        return RouteChoice(prefill[turn % len(prefill)], decode[turn % len(decode)])
