"""A role process's stop: phases in order, bounded in all, slow and stuck phases named."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
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


SIGNAL_ON_ANOTHER_THREAD = """
import signal, threading, time
from baton.worker.exit import StopSignals

stop = StopSignals()
def other():  # the kernel may hand a process's SIGTERM to any thread that does not block it
    time.sleep(0.3)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    time.sleep(60)  # this thread stays alive: only the main thread can end the process
threading.Thread(target=other, daemon=True).start()
print("got", stop.wait(), flush=True)
"""


def test_a_stop_signal_taken_by_another_thread_still_wakes_the_main_thread():
    """A worker once slept through SIGTERM: the kernel gave it to a gRPC thread, and the main
    thread, asleep on an Event, never ran the handler (the cluster killed it 3 s later)."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", SIGNAL_ON_ANOTHER_THREAD], capture_output=True,
                         text=True, timeout=20)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"got {int(signal.SIGTERM)}\n", "")
    assert time.monotonic() - t0 < 10
