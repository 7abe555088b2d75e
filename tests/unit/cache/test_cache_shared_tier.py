"""The shared tier on a real redis-server (started here, requirepass from the cluster secret):
one worker's evicted snapshot is another's hit, KV and state together; a store that goes
away, refuses the password or holds a state-less entry is a miss, never an error."""

from __future__ import annotations

import pytest
import torch

from baton.cache.manager import HybridCacheManager
from baton.cache.tiers import Tiers
from baton.cache.tiers.entry import Header, Layout
from baton.cache.tiers.shared import SharedTier
from baton.config.cache import CacheConfig, MambaStateConfig
from baton.config.cache_tiers import SharedStoreConfig
from baton.errors import ConfigError
from tests.support.redis_server import RedisServer, RedisUnavailable
from tests.unit.cache.test_cache_manager import TPB
from tests.unit.cache.test_cache_tiers import A, B, C, compute, pools, state_of

TOKEN = "tier-test-cluster-secret-0123456789"


@pytest.fixture(scope="module")
def server():
    srv = RedisServer(TOKEN)
    try:
        srv.start()
    except RedisUnavailable as e:
        pytest.skip(str(e))
    yield srv
    srv.stop()


@pytest.fixture
def store(server):
    server.client().flushdb()
    return server


def worker(url: str, token: str = TOKEN, model: str = "tiny") -> HybridCacheManager:
    cfg = CacheConfig(tokens_per_block=TPB, num_blocks=12, num_state_slots=3,
                      mamba_state_config=MambaStateConfig(decode_end_snapshot=False),
                      shared_store=SharedStoreConfig(url=url))
    p = pools(12, 3)
    layout = Layout(p, model)
    return HybridCacheManager(cfg, p, 1, tiers=Tiers(layout, None,
                                                     SharedTier(cfg.shared_store, layout, token)))


def test_one_workers_eviction_is_anothers_hit(store):
    w1, w2 = worker(store.url), worker(store.url)
    for rid, p, s in (("a", A, 10.0), ("b", B, 20.0), ("c", C, 30.0)):
        compute(w1, rid, p, s)
    assert w1.tiers.shared.stats.admitted == 1
    keys = [k for k in store.client().keys("baton:*") if not k.endswith(b"lengths")]
    assert len(keys) == 1  # one value: KV and state together
    adm = w2.admit("x", A + [3, 4])
    assert adm.cached_tokens == 9 and state_of(w2, adm.slot) == (10.0, 10.5)
    assert [float(w2.pools.kv[0, b, 0, 0, 0, 0]) for b in adm.block_table] == [10.0, 11.0, 12.0]
    assert w2.stats().tiers["shared"]["hits"] == 1
    w2.abort("x")
    w2.check_integrity()


def test_other_models_never_match(store):
    w1, w2 = worker(store.url), worker(store.url, model="another")
    for rid, p, s in (("a", A, 10.0), ("b", B, 20.0), ("c", C, 30.0)):
        compute(w1, rid, p, s)
    assert w2.admit("x", A + [1]).cached_tokens == 0


def test_state_less_entry_is_a_miss(store):
    """The LMCache failure, shared-store edition: a value with the KV but not the state."""
    w = worker(store.url)
    h, payload = w.layout.gather(A, [0, 1, 2], 0)
    kv_only = payload[: h.tokens + h.kv]
    import zlib

    bad = Header(h.fmt, h.n, h.tpb, h.tokens, h.kv, 0, zlib.crc32(kv_only.numpy()))
    (_, sh), = w.tiers.keys(A, [9])
    r = store.client()
    r.set(w.tiers.shared.key(sh), bad.encode() + kv_only.numpy().tobytes())
    r.sadd(w.tiers.shared._prefix + "lengths", 9)
    assert w.admit("x", A + [1]).cached_tokens == 0
    assert w.tiers.shared.stats.corrupt == 1
    w.abort("x")


def test_wrong_password_fails_at_start_in_one_line(store):
    with pytest.raises(ConfigError, match=r"cache.shared_store.url=redis://127.0.0.1:\d+/0 "
                                          r"refused authentication"):
        worker(store.url, token="some-other-cluster-secret-000")


def test_store_gone_mid_run_is_a_miss(tmp_path):
    srv = RedisServer(TOKEN)
    try:
        srv.start()
    except RedisUnavailable as e:
        pytest.skip(str(e))
    w1, w2 = worker(srv.url), worker(srv.url)
    for rid, p, s in (("a", A, 10.0), ("b", B, 20.0), ("c", C, 30.0)):
        compute(w1, rid, p, s)
    srv.stop()
    adm = w2.admit("x", A + [1])  # the store is gone: a miss, no error
    assert adm.cached_tokens == 0 and w2.tiers.shared.stats.errors == 1
    w2.abort("x")
    compute(w1, "d", [70 + x for x in A], 40.0)  # evicting with the store gone: still fine
    w1.check_integrity()
    w2.check_integrity()


def test_store_unreachable_at_start_is_a_warning_not_an_error():
    from baton.cluster.local import free_port

    w = worker(f"redis://127.0.0.1:{free_port()}/0")
    assert w.admit("x", A + [1]).cached_tokens == 0
    w.abort("x")


def test_maxmemory_bounds_the_store(server):
    srv = RedisServer(TOKEN, maxmemory="2mb")
    srv.start()
    try:
        w = worker(srv.url)
        tier = w.tiers.shared
        h, payload = w.layout.gather(A, [0, 1, 2], 0)
        big = torch.zeros(256 << 10, dtype=torch.uint8)
        for i in range(40):  # 40 x 256 KiB into 2 MiB
            hh = Header(h.fmt, h.n, h.tpb, h.tokens, h.kv, h.state, h.crc)
            tier.put(tier.key(i), hh, torch.cat([payload, big]))
        used = srv.client().info("memory")["used_memory"]
        assert used < 4 << 20 and tier.stats.errors == 0
    finally:
        srv.stop()
