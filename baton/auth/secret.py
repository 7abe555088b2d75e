"""The cluster secret: where it comes from and the keys derived from it."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path

from baton import envs
from baton.config.cluster import ClusterConfig
from baton.errors import ConfigError

log = logging.getLogger("baton.auth")

ENV_TOKEN = envs.CLUSTER_TOKEN.name
MIN_TOKEN_CHARS = 16
MAC_BYTES = 32
"""HMAC-SHA256 tag length."""


class ClusterSecret:
    """One cluster's shared secret; hands out a separate key per purpose."""

    def __init__(self, token: str):
        token = token.strip()
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(
                f"the cluster secret has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}; "
                f"make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'` "
                f"and put it in {ENV_TOKEN} or cluster.token_file"
            )
        self._root = token.encode()

    @staticmethod
    def generate() -> str:
        """A fresh random token (what `baton serve` gives its children)."""
        return secrets.token_urlsafe(32)

    def key(self, purpose: str) -> bytes:
        return hmac.new(self._root, f"baton/{purpose}".encode(), hashlib.sha256).digest()

    @cached_property
    def bearer(self) -> str:
        """What internal gRPC calls carry (`authorization: Bearer <this>`)."""
        return self.key("grpc-bearer").hex()

    def sign(self, purpose: str, data: bytes) -> bytes:
        return hmac.new(self.key(purpose), data, hashlib.sha256).digest()

    def verify(self, purpose: str, data: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.sign(purpose, data), bytes(mac))


def configured_token(cfg: ClusterConfig, environ: Mapping[str, str] = os.environ) -> str:
    """The token from `BATON_CLUSTER_TOKEN` or `cluster.token_file` (both set: they must
    agree); "" when neither is set."""
    env = environ.get(ENV_TOKEN, "").strip()
    from_file = _read_token_file(cfg.token_file) if cfg.token_file else ""
    if env and from_file and env != from_file:
        raise ConfigError(
            f"{ENV_TOKEN} and cluster.token_file ({cfg.token_file}) hold different secrets; "
            "set one of them, or make them equal"
        )
    return env or from_file


def load_secret(cfg: ClusterConfig, environ: Mapping[str, str] = os.environ,
                role: str = "process") -> ClusterSecret | None:
    """The configured secret (see `configured_token`); None, with a loud warning naming what
    is open, when there is none."""
    token = configured_token(cfg, environ)
    if not token:
        log.warning(
            "NO CLUSTER SECRET: this %s accepts internal calls (worker RPCs, registry, transfer "
            "side channel) from anyone who can reach its ports, and signs nothing. Set %s or "
            "cluster.token_file on every process of the cluster (`baton serve` does this itself)",
            role, ENV_TOKEN,
        )
        return None
    return ClusterSecret(token)


def _read_token_file(path: str) -> str:
    p = Path(path)
    try:
        token = p.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cluster.token_file {path!r} cannot be read: {e}") from e
    if not token:
        raise ConfigError(f"cluster.token_file {path!r} is empty; put the cluster secret in it")
    if p.stat().st_mode & 0o077:
        log.warning("cluster.token_file %s is readable by other users; chmod 600 it", path)
    return token
