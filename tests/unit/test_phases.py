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


class _IdleEngine:
    has_work = False


def test_loop_post_runs_before_later_calls_and_logs_a_failure(caplog):
    """`EngineLoop.post` (the prefill copy freed after the reply) does not wait, yet every
    call queued after it sees its effect; a failure is logged, not lost."""
    import threading

    from baton.engine.loop import EngineLoop

    loop = EngineLoop(_IdleEngine())
    try:
        gate, seen = threading.Event(), []
        loop.post(gate.wait, 5)  # the loop is busy with this one meanwhile
        loop.post(seen.append, "posted")
        assert seen == []  # post returned without waiting
        gate.set()
        assert loop.call(lambda: list(seen)) == ["posted"]

        def boom():
            raise ValueError("release failed")

        loop.post(boom).exception(timeout=5)
        loop.call(lambda: None)  # the failure's callback ran on the loop thread before this
        assert any("release failed" in r.getMessage() for r in caplog.records)
    finally:
        loop.stop()
