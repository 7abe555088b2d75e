"""The router section of the YAML config (built the way BatonConfig builds its sections)."""

from __future__ import annotations

import pytest

from baton.config.base import from_dict
from baton.config.router import RouterConfig
from baton.errors import ConfigError


def section(data):
    return from_dict(RouterConfig, data, "config.router")


def test_router_section_reads_every_field():
    cfg = section(
        {
            "policy": "prefix_aware",
            "eject_after_seconds": 2,
            "prefix_tree_max_nodes": 500,
            "prefix_load_slack": 3,
            "session_max_entries": 10,
            "reserve_timeout_seconds": 1.5,
        }
    )
    assert (cfg.policy, cfg.eject_after_seconds, cfg.prefix_tree_max_nodes) == (
        "prefix_aware",
        2.0,
        500,
    )
    assert (cfg.prefix_load_slack, cfg.session_max_entries, cfg.reserve_timeout_seconds) == (
        3,
        10,
        1.5,
    )


def test_unknown_policy_and_unknown_key_are_named():
    with pytest.raises(ConfigError, match="config.router.policy must be one of"):
        section({"policy": "random"})
    with pytest.raises(ConfigError, match="unknown config key config.router.polcy"):
        section({"polcy": "session"})
