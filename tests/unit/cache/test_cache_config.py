"""Cache config validation: every error names the field, the value and the fix."""

from __future__ import annotations

import logging

import pytest

from baton.cache.manager import HybridCacheManager
from baton.config import BatonConfig
from baton.config.base import from_dict
from baton.config.cache import CacheConfig, MambaStateConfig
from baton.errors import CapacityError, ConfigError
from baton.model.nemotron_h.config import ModelConfig
from baton.model.pools import Pools, PoolSpec

MODEL = ModelConfig.from_dict(
    dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M*M-", num_attention_heads=2,
         num_key_value_heads=1, head_dim=8, mamba_num_heads=4, mamba_head_dim=4,
         ssm_state_size=4, n_groups=1)
)


def cache(**mamba) -> CacheConfig:
    return from_dict(CacheConfig, {"tokens_per_block": 16, "mamba_state_config": mamba}, "cache")


@pytest.mark.parametrize(
    "mamba, field",
    [
        ({"additional_snapshot_offsets_from_start": [16, -3]},
         r"mamba_state_config\.additional_snapshot_offsets_from_start\[1\]=-3 must be > 0"),
        ({"additional_snapshot_offsets_from_start": [0]},
         r"additional_snapshot_offsets_from_start\[0\]=0 must be > 0"),
        ({"additional_snapshot_offsets_from_end": [0, -1]},
         r"additional_snapshot_offsets_from_end\[1\]=-1 must be >= 0"),
        ({"periodic_snapshot_interval": -16}, r"periodic_snapshot_interval=-16 is negative"),
        ({"periodic_snapshot_interval": 40},
         r"periodic_snapshot_interval=40 is not a multiple of cache\.tokens_per_block=16; "
         r"use 32 or 48"),
        ({"periodic_snapshot_interval": 8}, r"use 16 or 16"),
        ({"max_num_turns": -1}, r"max_num_turns=-1 must be >= 0"),
        ({"max_num_turns": 3}, r"max_num_turns=3 only applies with per_conversation"),
        ({"per_conversation": True, "periodic_snapshot_interval": 16},
         r"periodic_snapshot_interval=16 must be 0 when per_conversation"),
        ({"periodic_snapshot_interval": 16, "mamba_state_cache_interval": 32},
         r"both mamba_state_cache_interval=32 \(deprecated\) and periodic_snapshot_interval=16"),
    ],
)
def test_bad_policy_names_the_field(mamba, field):
    with pytest.raises(ConfigError, match=field):
        cache(**mamba)


@pytest.mark.parametrize("name", ["tokens_per_block", "num_blocks", "num_state_slots"])
def test_sizes_must_be_positive(name):
    with pytest.raises(ConfigError, match=rf"cache\.{name}=0 must be >= 1"):
        CacheConfig(**{name: 0})


def test_yaml_errors_carry_the_section_path():
    with pytest.raises(ConfigError, match=r"cache\.mamba_state_config\.periodic_snapshot_interval"):
        BatonConfig.from_dict({"cache": {"mamba_state_config": {"periodic_snapshot_interval": 20}}})
    with pytest.raises(ConfigError, match=r"unknown config key config\.cache\.mamba_state_con"):
        BatonConfig.from_dict({"cache": {"mamba_state_config": {"bogus": 1}}})


def test_deprecated_interval_alias_warns_and_maps():
    with pytest.warns(FutureWarning, match="mamba_state_cache_interval is deprecated"):
        c = cache(mamba_state_cache_interval=32)
    assert c.mamba_state_config.periodic_snapshot_interval == 32
    assert c.mamba_state_config.mamba_state_cache_interval is None
    with pytest.raises(ConfigError, match="not a multiple"):  # validated like the field
        with pytest.warns(FutureWarning):
            cache(mamba_state_cache_interval=24)


def test_reuse_without_any_policy_warns_and_disables():
    none = {"additional_snapshot_offsets_from_end": [], "decode_end_snapshot": False}
    with pytest.warns(UserWarning, match="no snapshot policy"):
        c = cache(**none)
    assert c.enable_prefix_reuse is False
    pools = Pools(PoolSpec.for_model(MODEL, num_blocks=8, tokens_per_block=16, num_slots=4))
    m = HybridCacheManager(c, pools, max_live=2)
    assert not m.reuse_enabled and m.snapshot_points(40) == []
    assert m.admit("a", list(range(40))) == (0, [], 0, ())


def test_policy_sources_each_count_as_a_policy():
    for mamba in (
        {"periodic_snapshot_interval": 16},
        {"additional_snapshot_offsets_from_start": [5]},
        {"additional_snapshot_offsets_from_end": [0]},
        {"decode_end_snapshot": True},
        {"per_conversation": True},
    ):
        base = {"additional_snapshot_offsets_from_end": [], "decode_end_snapshot": False}
        assert cache(**{**base, **mamba}).enable_prefix_reuse, mamba


def test_manager_rejects_pools_that_cannot_hold_the_live_slots():
    pools = Pools(PoolSpec.for_model(MODEL, num_blocks=8, tokens_per_block=16, num_slots=3))
    with pytest.raises(CapacityError, match=r"num_state_slots=3 .*max_num_seqs=4\).* at least 4"):
        HybridCacheManager(CacheConfig(num_state_slots=3), pools, max_live=4)
    with pytest.raises(ConfigError, match=r"tokens_per_block=16 but cache\.tokens_per_block=8"):
        HybridCacheManager(CacheConfig(tokens_per_block=8), pools, max_live=2)
    with pytest.raises(ConfigError, match="max_live=0"):
        HybridCacheManager(CacheConfig(), pools, max_live=0)


def test_no_snapshot_slot_left_disables_reuse_with_a_warning(caplog):
    pools = Pools(PoolSpec.for_model(MODEL, num_blocks=8, tokens_per_block=16, num_slots=3))
    with caplog.at_level(logging.WARNING, logger="baton.cache"):
        m = HybridCacheManager(CacheConfig(num_state_slots=3), pools, max_live=3)
    assert not m.reuse_enabled
    assert "num_state_slots=3 leaves no snapshot slot" in caplog.text


def test_mamba_state_config_accepts_lists_and_stays_hashable():
    c = MambaStateConfig(additional_snapshot_offsets_from_start=[4, 8])
    assert c.additional_snapshot_offsets_from_start == (4, 8)
    hash(c)
