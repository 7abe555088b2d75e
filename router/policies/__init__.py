"""Routing policies by name (RouterConfig.policy)."""

from __future__ import annotations

from baton.config.router import RouterConfig
from baton.errors import ConfigError
from router.policies.base import RouteChoice, RouteRequest, RoutingPolicy
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.prefix_aware import PrefixAwarePolicy
from router.policies.round_robin import RoundRobinPolicy
from router.policies.session import SessionPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "prefix_aware": PrefixAwarePolicy,
    "session": SessionPolicy,
}


def make_policy(config: RouterConfig) -> RoutingPolicy:
    cls = POLICIES.get(config.policy)
    if cls is None:
        raise ConfigError(
            f"router.policy {config.policy!r} is unknown; choose one of {sorted(POLICIES)}"
        )
    return cls(config)


__all__ = ["POLICIES", "RouteChoice", "RouteRequest", "RoutingPolicy", "make_policy"]
