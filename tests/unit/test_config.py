"""Config files: every section loads, unknown keys and wrong types are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_example_config_loads_with_its_values():
    cfg = BatonConfig.load(ROOT / "deploy" / "config.example.yaml")
    assert cfg.router.policy == "session"
    assert cfg.cache.mamba_state_config.periodic_snapshot_interval == 256
    assert cfg.cache.mamba_state_config.additional_snapshot_offsets_from_end == (0,)
    assert cfg.transfer.backend == "nixl"


def test_defaults_without_a_file():
    cfg = BatonConfig.load(None)
    assert cfg.model.path == "tiny" and cfg.cache.tokens_per_block == 16


@pytest.mark.parametrize(
    "data, msg",
    [
        ({"cache": {"tokens_per_blok": 16}}, "config.cache.tokens_per_blok"),
        ({"cache": {"mamba_state_config": {"bogus": 1}}}, "config.cache.mamba_state_config.bogus"),
        ({"modle": {}}, "config.modle"),
        ({"cache": {"tokens_per_block": "16"}}, "config.cache.tokens_per_block must be an integer"),
        ({"cache": {"enable_prefix_reuse": 1}}, "enable_prefix_reuse must be true or false"),
        ({"router": {"policy": "random"}}, "config.router.policy must be one of"),
        ({"transfer": {"backend": "tcp"}}, "config.transfer.backend must be one of"),
        ({"cache": []}, "config.cache must be a mapping"),
    ],
)
def test_bad_keys_and_values_are_named(data, msg):
    with pytest.raises(ConfigError, match=msg.replace(".", r"\.")):
        BatonConfig.from_dict(data)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        BatonConfig.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        BatonConfig.load(bad)

