"""Per-tier figures in Stats (`tier_<tier>_<counter>`) and /metrics (`baton_tier_*{tier}`)."""

from __future__ import annotations

import types

from prometheus_client import CollectorRegistry, generate_latest

from baton.agents.grammar import Grammars
from baton.worker.load import counters_of
from baton.worker.metrics import TIER_SERIES, _EngineCollector
from tests.unit.cache.test_cache_tiers import A, B, C, compute, make


class Loop:
    def __init__(self, cache):
        self.engine = types.SimpleNamespace(
            cache=cache, scheduler=types.SimpleNamespace(running=[], waiting=[]),
            prefilled_tokens=0, spec=None, requests={}, model=None, pools=cache.pools,
            weights=None, grammars=Grammars(None, 8, frozenset()))

    def call(self, fn):
        return fn()


def served(tmp_path):
    m = make(tmp_path)
    for rid, p, s in (("a", A, 10.0), ("b", B, 20.0), ("c", C, 30.0)):
        compute(m, rid, p, s)  # A's snapshot goes to disk
    m.admit("x", A + [1])  # back from disk (B's snapshot leaves the pool for it)
    m.abort("x")
    return m


def test_stats_carry_each_tiers_counters(tmp_path):
    m = served(tmp_path)
    out = counters_of(Loop(m))
    assert out["tier_hit_tokens"] == 9.0
    assert out["tier_disk_hits"] == 1.0 and out["tier_disk_hit_tokens"] == 9.0
    assert out["tier_disk_admitted"] == 2.0 and out["tier_disk_evicted"] == 0.0
    assert out["tier_disk_bytes_read"] > 0 and out["tier_disk_corrupt"] == 0.0
    assert out["integrity_ok"] == 1.0


def test_metrics_have_one_series_per_tier(tmp_path):
    reg = CollectorRegistry()
    reg.register(_EngineCollector("prefill", Loop(served(tmp_path))))
    text = generate_latest(reg).decode()
    assert 'baton_tier_hits_total{role="prefill",tier="disk"} 1.0' in text
    assert 'baton_tier_hit_tokens_total{role="prefill",tier="disk"} 9.0' in text
    assert 'baton_tier_admitted_total{role="prefill",tier="disk"} 2.0' in text
    for key in TIER_SERIES:
        assert f"# TYPE baton_tier_{key}_total counter" in text
