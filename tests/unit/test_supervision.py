"""`baton serve` supervision: a dead process restarts after a doubling, logged backoff."""

from __future__ import annotations

import logging
import threading

from baton.cluster import local
from baton.cluster.local import LocalCluster


class FakeProc:
    def __init__(self, args, pid):
        self.args, self.pid, self.returncode = args, pid, None

    def poll(self):
        return self.returncode


def cluster_of(procs) -> LocalCluster:
    c = LocalCluster.__new__(LocalCluster)  # no processes: only the supervision state
    c.procs, c.restarts = list(procs), [0] * len(procs)
    c._started, c._deaths, c._due = [0.0] * len(procs), [0] * len(procs), {}
    c._stopping = threading.Event()
    c._supervisor = None
    c.expected = len(procs)
    return c


def test_a_dead_process_restarts_with_a_doubling_backoff_reset_once_it_ran_long(
        monkeypatch, caplog):
    args = ["python", "-m", "baton.cli", "--log-level", "INFO", "decode-worker", "--router", "x"]
    c = cluster_of([FakeProc(["python", "-m", "baton.cli", "router"], 10), FakeProc(args, 11)])
    started = []
    monkeypatch.setattr(c, "_popen", lambda cmd: started.append(cmd) or FakeProc(
        cmd, 100 + len(started)))
    caplog.set_level(logging.WARNING, logger="baton.serve")
    restarts_at = []
    t = 1.0
    for _ in range(4):  # dies 1 s after each start: 0.5 s, 1 s, 2 s, 4 s
        c.procs[1].returncode = -9
        c.check_children(now=t)
        delay = c._due[1] - t
        c.check_children(now=t + delay - 0.01)
        assert len(started) == len(restarts_at)  # not before its time
        c.check_children(now=t + delay)
        restarts_at.append(delay)
        t += delay + 1.0
    assert restarts_at == [0.5, 1.0, 2.0, 4.0]
    assert started == [args] * 4 and c.restarts == [0, 4] and c.procs[0].pid == 10
    assert "decode-worker (pid 11) exited with code -9 after 1.0s; restarting it in 0.5s" \
        in caplog.text
    assert "restarted decode-worker as pid 101 (restart 1)" in caplog.text
    # one that ran past STABLE_S starts over at the first delay; the cap holds
    c.procs[1].returncode = 1
    c.check_children(now=t + local.STABLE_S)
    assert c._due[1] - (t + local.STABLE_S) == local.RESTART_FIRST_S
    c._deaths[1] = 20
    c._started[1] = 0.0
    del c._due[1]
    c.check_children(now=1.0)
    assert c._due[1] - 1.0 == local.RESTART_MAX_S


def test_nothing_restarts_once_stopping():
    c = cluster_of([FakeProc(["router"], 1)])
    c.procs[0].returncode = 0
    c._stopping.set()
    c.check_children(now=5.0)
    assert c._due == {}
