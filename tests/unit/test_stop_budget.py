"""A role process's stop: phases in order, bounded in all, slow and stuck phases named."""

from __future__ import annotations

import logging
import re
import threading
import time

from baton.worker.exit import timed_stop


def test_a_stuck_phase_ends_the_stop_at_the_budget_and_is_named(caplog):
    ran, release = [], threading.Event()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="baton.exit"):
        timed_stop("worker w1", budget_s=0.3, phases=[
            ("first", lambda: ran.append("first")),
            ("transfer", release.wait),
            ("never", lambda: ran.append("never")),
        ])
    took = time.monotonic() - t0
    release.set()
    assert 0.3 <= took < 1.0
    assert ran == ["first"]
    assert [r.getMessage() for r in caplog.records] == [
        "worker w1: stopping transfer still running after 0.3s; exiting without it "
        "(slow: none)"]


def test_a_failing_phase_does_not_skip_the_rest_and_slow_ones_are_reported(caplog):
    ran = []

    def boom():
        raise RuntimeError("gone")

    with caplog.at_level(logging.WARNING, logger="baton.exit"):
        timed_stop("router", budget_s=None, phases=[
            ("http", boom), ("grpc", lambda: time.sleep(0.6)), ("last", lambda: ran.append(1))])
    assert ran == [1]
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "router: stopping http failed"
    assert len(messages) == 2
    assert re.fullmatch(r"router stopped in \d\.\ds \(slow: grpc 0\.[6-9]s\)", messages[1])
