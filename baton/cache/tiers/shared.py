"""The shared tier: entries in a Redis every worker reaches (`cache.shared_store.url`).

    baton:<fmt>:<snapshot_hash>   one value: the whole entry (entry.py), KV and state together
    baton:<fmt>:lengths           set of the token counts entries exist for (lookup candidates)

`fmt` names the model and every layout (entry.Layout), `snapshot_hash` is the contract's
prefix hash (baton/contract/prefix_hash.py), so workers of one model share entries and no
other model's entry can match. The store is bounded by its own `maxmemory` and eviction; the
password is derived from the cluster secret (`store_password`) unless the URL has one. Any
error or timeout is a miss (never a failed request) and keeps the store unused for
`RETRY_S` seconds, so a store that went away costs one timeout, not one per request.
"""

from __future__ import annotations

import logging
import time

import torch

from baton.cache.tiers.entry import BadEntry, Header, Layout, split
from baton.cache.tiers.stats import TierCounters
from baton.config.cache_tiers import SharedStoreConfig
from baton.errors import ConfigError

log = logging.getLogger("baton.cache.tiers")

RETRY_S = 5.0


def store_password(token: str) -> str:
    """The Redis password of a cluster whose secret is `token` (requirepass of the store)."""
    from baton.auth.secret import ClusterSecret

    return ClusterSecret(token).key("shared-store").hex()


class SharedTier:
    name = "shared"

    def __init__(self, cfg: SharedStoreConfig, layout: Layout, token: str = ""):
        import redis

        self.cfg, self.layout = cfg, layout
        self.stats = TierCounters()
        self._errors = (redis.RedisError, OSError)
        kw = dict(socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s)
        url_has_password = "@" in cfg.url.split("//", 1)[1].split("/", 1)[0]
        if token and not url_has_password:
            kw["password"] = store_password(token)
        self.r = redis.Redis.from_url(cfg.url, **kw)
        self._prefix = f"baton:{layout.fmt}:"
        self._down_until = 0.0
        try:
            self.r.ping()
        except redis.AuthenticationError as e:
            raise ConfigError(
                f"cache.shared_store.url={_safe(cfg.url)} refused authentication ({e}); give "
                "the store requirepass = store_password(cluster secret), or a password in the "
                "URL") from None
        except redis.ResponseError as e:
            if "NOAUTH" in str(e) or "AUTH" in str(e):
                raise ConfigError(
                    f"cache.shared_store.url={_safe(cfg.url)} refused authentication ({e})"
                ) from None
            raise
        except self._errors as e:
            log.warning("shared store %s is not reachable now (%s): a miss until it is",
                        _safe(cfg.url), e)
            self._down_until = time.monotonic() + RETRY_S
        log.info("shared store %s (entries under %s*)", _safe(cfg.url), self._prefix)

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: Exception) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + RETRY_S
        log.warning("shared store %s failed (%s): a miss; not used for %.0fs", what, e, RETRY_S)

    def key(self, snapshot_hash: int) -> str:
        return f"{self._prefix}{snapshot_hash:016x}"

    def lengths(self) -> list[int]:
        if not self._up():
            return []
        try:
            return sorted(int(x) for x in self.r.smembers(self._prefix + "lengths"))
        except self._errors as e:
            self._failed("lookup", e)
            return []

    def find(self, keys: list[tuple[int, str]]) -> tuple[int, str] | None:
        """The first of `keys` ((n, key), deepest first) the store holds."""
        if not keys or not self._up():
            return None
        try:
            pipe = self.r.pipeline(transaction=False)
            for _, k in keys:
                pipe.exists(k)
            found = pipe.execute()
        except self._errors as e:
            self._failed("lookup", e)
            return None
        return next((nk for nk, f in zip(keys, found, strict=True) if f), None)

    def get(self, key: str, tokens: list[int]) -> tuple[Header, torch.Tensor] | None:
        if not self._up():
            return None
        try:
            blob = self.r.get(key)
        except self._errors as e:
            self._failed("read", e)
            return None
        if blob is None:
            return None  # evicted by the store meanwhile
        try:
            h, payload = split(blob)
            self.layout.check_header(h)
            self.layout.check_payload(h, payload, tokens)
        except BadEntry as e:
            log.warning("shared store entry %s is not usable (%s): a miss", key, e)
            self.stats.corrupt += 1
            return None
        self.stats.bytes_read += len(blob)
        return h, payload

    def put(self, key: str, h: Header, payload: torch.Tensor) -> bool:
        head = h.encode()
        size = len(head) + payload.numel()
        if size > self.cfg.max_entry_bytes:
            self.stats.rejected += 1
            return False
        if not self._up():
            return False
        try:
            pipe = self.r.pipeline(transaction=True)
            pipe.set(key, head + payload.numpy().tobytes(), nx=True)
            pipe.sadd(self._prefix + "lengths", h.n)
            written, _ = pipe.execute()
        except self._errors as e:
            self._failed("write", e)
            return False
        if written:
            self.stats.admitted += 1
            self.stats.bytes_written += size
        return True


def _safe(url: str) -> str:
    """The URL without a password in it (for logs and errors)."""
    scheme, rest = url.split("//", 1)
    host = rest.split("@", 1)[1] if "@" in rest.split("/", 1)[0] else rest
    return f"{scheme}//{host}"


if __name__ == "__main__":  # `python -m baton.cache.tiers.shared`: the store's requirepass
    from baton.auth.secret import configured_token
    from baton.config.cluster import ClusterConfig

    _token = configured_token(ClusterConfig())
    if not _token:
        raise SystemExit("set BATON_CLUSTER_TOKEN to the cluster secret first")
    print(store_password(_token))
