"""A request's phases (baton/worker/phases.py): durations, and the metadata that carries them."""

from __future__ import annotations

import json

from baton.worker import phases


def test_clock_durations_and_unmeasured_phases():
    c = phases.Clock()
    c.at["a"], c.at["b"] = c.t0 + 0.001, c.t0 + 0.0035
    assert round(c.ms(None, "a"), 6) == 1.0
    assert round(c.ms("a", "b"), 6) == 2.5
    assert c.ms("a", "never") is None
    assert phases.mono_ms(None, 1.0) is None
    assert phases.clean({"x": 1.23456, "y": None, "z": -0.001}) == {"x": 1.235, "z": 0.0}


def test_metadata_round_trip():
    md = phases.to_metadata({"p_total": 12.5, "r_rpc": 0.25})
    assert phases.from_metadata([("other", "1"), *md]) == {"p_total": 12.5, "r_rpc": 0.25}
    assert phases.to_metadata({}) == ()
    assert phases.from_metadata(None) == {}


def test_malformed_or_oversized_metadata_is_ignored():
    key = phases.METADATA_KEY
    assert phases.from_metadata([(key, "not json")]) == {}
    assert phases.from_metadata([(key, "[1, 2]")]) == {}
    assert phases.from_metadata([(key, json.dumps({"a": "x"}))]) == {}
    big = json.dumps({f"k{i}": 1.0 for i in range(400)})
    assert len(big) > phases.MAX_METADATA_BYTES
    assert phases.from_metadata([(key, big)]) == {}

