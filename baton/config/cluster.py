"""Cluster section of the config: the shared secret and the mutual TLS of one cluster."""

from __future__ import annotations

from dataclasses import dataclass

from baton.errors import ConfigError

TLS_KEYS = ("tls_cert_file", "tls_key_file", "tls_ca_file")


@dataclass(frozen=True)
class ClusterConfig:
    token_file: str = ""
    """File holding the cluster secret (one line, at least 16 characters). Every internal
    call (worker RPCs, the registry, the transfer side channel) proves it; decode workers sign
    reservations with it. `BATON_CLUSTER_TOKEN` in the environment does the same; `baton
    serve` makes a random one for its children. Neither set: no authentication (a warning)."""
    tls_cert_file: str = ""
    """Mutual TLS between cluster processes (PEM): this process's certificate, served by its
    gRPC server and presented to its peers. Set all three `tls_*` keys or none; the
    certificate must name the address the process is reached at (IP or DNS subjectAltName).
    Encrypts and authenticates the transport; the cluster secret is still required."""
    tls_key_file: str = ""
    """Private key of tls_cert_file (PEM)."""
    tls_ca_file: str = ""
    """CA certificate(s) (PEM) that every peer's certificate must chain to; also verifies the
    router's certificate (bundle router.tls_cert_file's CA here if another CA issued it)."""

    def __post_init__(self) -> None:
        given = [k for k in TLS_KEYS if getattr(self, k)]
        if given and len(given) < len(TLS_KEYS):
            missing = [f"cluster.{k}" for k in TLS_KEYS if k not in given]
            raise ConfigError(
                f"cluster.{given[0]} is set but {', '.join(missing)} is not: mutual TLS needs "
                "this process's certificate, its key and the cluster CA; set all three or none"
            )
