"""Config files: every section loads, unknown keys and wrong types are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.config import BatonConfig
from baton.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


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



# ---- pipeline parallelism -----------------------------------------------------------------

def test_pp_partition_errors_name_the_field():
    from baton.model.partition import partition_layers

    with pytest.raises(ConfigError, match=r"worker.pp_layer_partition \[3, 3, 1\] sums to 7"):
        partition_layers(8, 3, (3, 3, 1))
    with pytest.raises(ConfigError, match="worker.pipeline_parallel_size=9 is larger than"):
        partition_layers(8, 9)
    with pytest.raises(ConfigError, match=r"worker.pp_layer_partition \[4, 0, 4\] gives stage 1"):
        BatonConfig.from_dict({"worker": {"pipeline_parallel_size": 3,
                                          "pp_layer_partition": [4, 0, 4]}})
    with pytest.raises(ConfigError, match="worker.pipeline_parallel_size must be >= 1"):
        BatonConfig.from_dict({"worker": {"pipeline_parallel_size": 0}})
    with pytest.raises(ConfigError, match="has 2 stages but worker.pipeline_parallel_size is 3"):
        BatonConfig.from_dict({"decode": {"pipeline_parallel_size": 3,
                                          "pp_layer_partition": [4, 4]}})
    assert [list(r) for r in partition_layers(8, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [list(r) for r in partition_layers(8, 3, (3, 3, 2))] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_per_role_worker_overrides():
    cfg = BatonConfig.from_dict({
        "worker": {"max_num_seqs": 8},
        "prefill": {"pipeline_parallel_size": 3, "pp_layer_partition": [3, 3, 2]},
        "decode": {"pipeline_parallel_size": 2},
    })
    assert cfg.worker.pipeline_parallel_size == 1
    p, d = cfg.for_role("prefill").worker, cfg.for_role("decode").worker
    assert (p.pipeline_parallel_size, p.pp_layer_partition, p.max_num_seqs) == (3, (3, 3, 2), 8)
    assert (d.pipeline_parallel_size, d.pp_layer_partition) == (2, ())
    with pytest.raises(ConfigError, match="unknown config key prefill.bogus"):
        BatonConfig.from_dict({"prefill": {"bogus": 1}})
