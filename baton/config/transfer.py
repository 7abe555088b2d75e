"""Transfer section of the config: backend choice, side-channel ports, leases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from baton.contract.types import DEFAULT_LEASE_SECONDS


@dataclass(frozen=True)
class TransferConfig:
    backend: Literal["nixl", "ucx"] = "nixl"
    """`nixl` (NIXL agent, UCX backend) or `ucx` (ucxx directly)."""
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    """Blocks/slots held for a pending transfer are freed on both sides after this."""
    layerwise: bool = True
    """The prefill worker posts each layer's KV/state as soon as its last chunk computed that
    layer, so the handoff ends with the forward pass (`bench handoff`: 0.3 ms of handoff after
    the first token against 4.5 ms without); false: the whole request after the first token."""
    handshake_timeout_s: float = 10.0
    """How long a sender waits for a decode side-channel reply before failing the request."""
    max_message_bytes: int = 16 * 1024 * 1024
    """Largest side-channel message accepted; bigger ones are dropped unread."""
    ucx_tls: str = ""
    """UCX_TLS for the transport ("" = UCX's choice: cma + tcp on CPU hosts; "tcp" without ptrace)."""
