"""least_loaded: the worker with the fewest requests (reported or routed), per role."""

from __future__ import annotations

from collections.abc import Sequence

from baton.contract import WorkerView
from router.policies.base import RouteChoice, RouteRequest, RoutingPolicy, least_loaded


class LeastLoadedPolicy(RoutingPolicy):
    def choose(
        self, request: RouteRequest, prefill: Sequence[WorkerView], decode: Sequence[WorkerView]
    ) -> RouteChoice:
        return RouteChoice(least_loaded(prefill), least_loaded(decode))
