"""TLS for Baton's gRPC and HTTP: the router's public certificate and mutual TLS in the cluster.

    router.tls_cert_file / tls_key_file     the router's public gRPC port and HTTP API serve
                                            this certificate; clients need none of their own
    cluster.tls_cert_file / tls_key_file /  every cluster process serves its certificate and
            tls_ca_file                     presents it as a client; peers must chain to the CA
                                            (mutual TLS): worker gRPC servers, router -> worker
                                            and worker -> registry channels

Which credentials the router's port (public API and Registry on one port) serves:

    router.tls_*   cluster.tls_*   router port
    set            any             TLS with the router certificate, no client certificate
                                   (the Registry on it still needs the cluster secret)
    unset          set             mutual TLS under the cluster CA, like every cluster port
    unset          unset           plaintext

Cluster processes verify the router against cluster.tls_ca_file when it is set (bundle the
router certificate's CA into it if another CA issued it), else against the system trust store.
Certificates must name the address a process is reached at (IP or DNS subjectAltName).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

from baton.config.cluster import ClusterConfig
from baton.config.router import RouterConfig
from baton.errors import ConfigError


@dataclass(frozen=True)
class CertKey:
    """A certificate chain and its private key (PEM), and the files they came from."""

    cert: bytes
    key: bytes
    cert_file: str
    key_file: str


@dataclass(frozen=True)
class ClusterTls:
    """Mutual TLS between cluster processes: this process's certificate and the cluster CA."""

    own: CertKey
    ca: bytes
    ca_file: str

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serves `own`; a client without a certificate from the cluster CA is refused."""
        return grpc.ssl_server_credentials([(self.own.key, self.own.cert)],
                                           root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Presents `own`; the server must chain to the cluster CA."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.own.key,
                                            certificate_chain=self.own.cert)

    def ssl_context(self) -> ssl.SSLContext:
        """The same, for HTTPS clients (health probes of the router's HTTP API)."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.load_cert_chain(self.own.cert_file, self.own.key_file)
        return ctx


def cluster_tls(cfg: ClusterConfig) -> ClusterTls | None:
    """The configured `cluster.tls_*` files, read and checked (None when unset)."""
    if not cfg.tls_cert_file:
        return None
    own = _cert_key(cfg.tls_cert_file, cfg.tls_key_file, "cluster")
    return ClusterTls(own, _read(cfg.tls_ca_file, "cluster.tls_ca_file", "CERTIFICATE"),
                      cfg.tls_ca_file)


def router_tls(cfg: RouterConfig) -> CertKey | None:
    """The configured `router.tls_*` files, read and checked (None when unset)."""
    if not cfg.tls_cert_file:
        return None
    return _cert_key(cfg.tls_cert_file, cfg.tls_key_file, "router")


def router_server_credentials(public: CertKey | None,
                              cluster: ClusterTls | None) -> grpc.ServerCredentials | None:
    """What the router's port serves (see the table above); None: plaintext."""
    if public is not None:
        return grpc.ssl_server_credentials([(public.key, public.cert)])
    return None if cluster is None else cluster.server_credentials()


def router_channel_credentials(router_cfg: RouterConfig,
                               cluster: ClusterTls | None) -> grpc.ChannelCredentials | None:
    """How a cluster process (worker registration, `baton serve`) reaches the router."""
    if cluster is not None:
        return cluster.channel_credentials()
    if router_cfg.tls_cert_file:
        return grpc.ssl_channel_credentials()  # a public certificate: the system trust store
    return None


def http_ssl_args(public: CertKey | None, cluster: ClusterTls | None) -> dict:
    """uvicorn's TLS arguments for the router's HTTP API (the same table as its gRPC port)."""
    if public is not None:
        return {"ssl_certfile": public.cert_file, "ssl_keyfile": public.key_file}
    if cluster is not None:
        return {"ssl_certfile": cluster.own.cert_file, "ssl_keyfile": cluster.own.key_file,
                "ssl_ca_certs": cluster.ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return {}


def _cert_key(cert_file: str, key_file: str, section: str) -> CertKey:
    cert = _read(cert_file, f"{section}.tls_cert_file", "CERTIFICATE")
    key = _read(key_file, f"{section}.tls_key_file", "PRIVATE KEY")
    try:  # a certificate with another certificate's key fails here, not at the first handshake
        ssl.create_default_context().load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        raise ConfigError(f"{section}.tls_key_file {key_file!r} is not the private key of "
                          f"{section}.tls_cert_file {cert_file!r} ({e})") from None
    return CertKey(cert, key, cert_file, key_file)


def _read(path: str, field: str, kind: str) -> bytes:
    try:
        data = open(path, "rb").read()
    except OSError as e:
        raise ConfigError(f"{field} {path!r} cannot be read: {e.strerror}") from None
    if b"-----BEGIN " not in data or kind.encode() not in data:
        raise ConfigError(f"{field} {path!r} holds no PEM {kind.lower()} "
                          f"(-----BEGIN ...{kind}-----)")
    return data
