"""Router section of the config: routing policy and worker liveness."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RouterConfig:
    policy: Literal["round_robin", "least_loaded", "prefix_aware", "session"] = "round_robin"
    heartbeat_seconds: float = 1.0
    """Workers heartbeat this often."""
    eject_after_seconds: float = 5.0
    """A worker silent this long is ejected."""
    max_retries: int = 2
    """Retries on another worker pair when one fails before the first token."""
    prefix_tree_max_nodes: int = 100_000
    """Bound on the prefix_aware policy's tree."""
