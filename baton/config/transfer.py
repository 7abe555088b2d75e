"""Transfer section of the config: backend choice, side-channel ports, leases."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from baton.config.ports import PortRange, port_range
from baton.contract.types import DEFAULT_LEASE_SECONDS


@dataclass(frozen=True)
class TransferConfig:
    backend: Literal["nixl", "ucx"] = "nixl"
    """`nixl` (NIXL agent, UCX backend) or `ucx` (ucxx directly)."""
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    """Blocks/slots held for a pending transfer are freed on both sides after this."""
    layerwise: bool = False
    """The prefill worker posts each layer's KV/state as soon as its last chunk computed that
    layer, so the bytes have landed when the forward ends (0.1 ms of handoff after the first
    token instead of 3 ms at 8k tokens). Off by default on CPU hosts: with UCX `cma` the
    posting thread does the copy, so it lengthens the forward instead of hiding the copy
    (`bench handoff`, quiet machine: 8k TTFT +3.6% layer-wise vs +2.6% / -0.7% whole)."""
    handshake_timeout_s: float = 10.0
    """How long a sender waits for a decode side-channel reply before failing the request."""
    max_message_bytes: int = 16 * 1024 * 1024
    """Largest side-channel message accepted; bigger ones are dropped unread."""
    ucx_tls: str = ""
    """UCX_TLS for the transport ("" = UCX's choice: cma + tcp on CPU hosts; "tcp" without ptrace
    or between network namespaces of one host, where UCX would still use cma). TCP alone also
    keeps UCX to the interface of the worker's advertised address (UCX_NET_DEVICES)."""
    side_channel_port: int | str = 0
    """Decode workers' ZeroMQ side-channel port: 0 = any free port, N, or "FIRST-LAST" (the
    first free port of the range)."""
    ucx_port: int | str = 0
    """Ports UCX listens on for the KV data, same forms as `side_channel_port`. `nixl`: every
    worker's UCX TCP port (UCX_TCP_PORT_RANGE); `ucx`: the decode worker's ucxx listener."""

    def __post_init__(self) -> None:
        _ = self.side_channel_ports, self.ucx_ports  # refused when the config loads

    @cached_property
    def side_channel_ports(self) -> PortRange:
        return port_range(self.side_channel_port, "transfer.side_channel_port")

    @cached_property
    def ucx_ports(self) -> PortRange:
        return port_range(self.ucx_port, "transfer.ucx_port")

    @cached_property
    def tcp_only(self) -> bool:
        """`ucx_tls` names TCP as UCX's only network transport (no RDMA, no shared memory)."""
        names = {t.strip() for t in self.ucx_tls.split(",") if t.strip()}
        return "tcp" in names and names <= {"tcp", "self"}

    @cached_property
    def ucx_env(self) -> dict[str, str]:
        """UCX environment variables this section sets (the backends apply them before UCX
        starts; UCX reads them once per process)."""
        env = {"UCX_TLS": self.ucx_tls} if self.ucx_tls else {}
        if not self.ucx_ports.any:
            env["UCX_TCP_PORT_RANGE"] = f"{self.ucx_ports.first}-{self.ucx_ports.last}"
        return env
