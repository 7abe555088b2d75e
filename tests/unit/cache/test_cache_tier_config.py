"""cache.tier / shared_store / eviction: bad values fail at start in one line naming them."""

from __future__ import annotations

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError
from tests.support.engine_helpers import make_checkpoint


@pytest.mark.parametrize("cache, message", [
    ({"tier": {"path": "/tmp/x"}}, r"cache.tier.path='/tmp/x' is set but cache.tier.bytes is 0"),
    ({"tier": {"path": "/tmp/x", "bytes": -1}}, r"cache.tier.bytes=-1 must be >= 0"),
    ({"tier": {"path": "/tmp/x", "bytes": 10, "io": "uring"}}, r"cache.tier.io must be one of"),
    ({"shared_store": {"url": "memcached://h:1"}}, r"cache.shared_store.url='memcached://h:1' "
                                                   r"must start with redis://"),
    ({"eviction": {"policy": "lfu"}}, r"cache.eviction.policy must be one of \['lru', 'value'\]"),
    ({"eviction": {"alpha": -1}}, r"cache.eviction.alpha=-1.0 must be >= 0"),
])
def test_bad_values_name_the_key(cache, message):
    with pytest.raises(ConfigError, match=message):
        BatonConfig.from_dict({"cache": cache})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tier_config"))


def test_split_workers_refuse_tiers_in_one_line(tmp_path, model):
    from baton.engine.builder import build_engine

    cfg = BatonConfig.from_dict({"cache": {"tier": {"path": str(tmp_path / "t"), "bytes": 1 << 30}},
                                 "worker": {"pipeline_parallel_size": 2}})
    with pytest.raises(ConfigError, match=r"cache.tier / cache.shared_store are not supported "
                                          r"with worker.tensor_parallel_size"):
        build_engine(cfg, str(model))


def test_unwritable_tier_path_fails_at_start(tmp_path, model):
    from baton.engine.builder import build_engine

    (tmp_path / "file").write_text("x")
    cfg = BatonConfig.from_dict({"cache": {"tier": {"path": str(tmp_path / "file" / "tier"),
                                                    "bytes": 1 << 30, "io": "file"}}})
    with pytest.raises(ConfigError, match=r"cache.tier.path=.*file/tier.* cannot hold the disk "
                                          r"tier"):
        build_engine(cfg, str(model))
