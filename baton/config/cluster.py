"""Cluster section of the config: the shared secret every Baton process of one cluster holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterConfig:
    token_file: str = ""
    """File holding the cluster secret (one line, at least 16 characters). Every internal
    call (worker RPCs, the registry, the transfer side channel) proves it; decode workers sign
    reservations with it. `BATON_CLUSTER_TOKEN` in the environment does the same; `baton
    serve` makes a random one for its children. Neither set: no authentication (a warning)."""
    tls_cert_file: str = ""
    """Mutual TLS between cluster processes: not supported yet (refused when set)."""
    tls_key_file: str = ""
    """See tls_cert_file."""
    tls_ca_file: str = ""
    """See tls_cert_file."""
