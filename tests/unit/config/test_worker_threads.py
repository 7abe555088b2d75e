"""`worker.torch_threads`: an engine process's torch threads as a config key; 0 keeps the
environment's BATON_NUM_THREADS (what `baton serve`, tests and benchmarks set), and a bad
value is refused naming the key."""

from __future__ import annotations

import pytest

from baton.config import BatonConfig
from baton.engine.process import rank_threads, threads_of
from baton.errors import ConfigError


def test_the_key_wins_over_the_environment_and_0_reads_it(monkeypatch):
    monkeypatch.setenv("BATON_NUM_THREADS", "3")
    assert threads_of(BatonConfig.from_dict({})) == 3
    cfg = BatonConfig.from_dict({"worker": {"torch_threads": 4}})
    assert threads_of(cfg) == 4
    assert rank_threads(cfg, 2) == 2
    monkeypatch.delenv("BATON_NUM_THREADS")
    assert threads_of(BatonConfig.from_dict({})) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_value_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match=r"worker\.torch_threads"):
        BatonConfig.from_dict({"worker": {"torch_threads": bad}})
