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



def test_rpc_split_on_one_host_and_not_across_hosts():
    # router: call opened at 10.000 s, reply held at 10.050 s; worker: arrival 10.002 s,
    # reply built 10.049 s (ms on the same clock)
    assert [round(x, 6) for x in phases.split_rpc(10002.0, 10049.0, 10.0, 10.05)] == [2.0, 1.0]
    # another host's clock: shares outside the call are no measurement
    assert phases.split_rpc(5.0, 9.0, 10.0, 10.05) == (None, None)
    assert phases.split_rpc(None, 10049.0, 10.0, 10.05) == (None, None)
    # the instants travel with the phases but are not phases
    assert phases.durations({"p_total": 1.0, phases.AT_FIRST_CHUNK: 5.0}) == {"p_total": 1.0}
