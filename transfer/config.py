"""Transfer section of the config: backend choice, side-channel ports, leases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TransferConfig:
    backend: Literal["nixl", "ucx"] = "nixl"
    """`nixl` (NIXL agent, UCX backend) or `ucx` (ucxx directly)."""
    lease_seconds: float = 30.0
    """Blocks/slots held for a pending transfer are freed on both sides after this."""
    layerwise: bool = False
    """Stream each layer's KV/state as soon as prefill finishes it."""
