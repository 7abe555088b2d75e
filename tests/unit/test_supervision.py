"""`baton serve` supervision: a dead process restarts after a doubling, logged backoff."""

from __future__ import annotations

import logging
import socket
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
    c._reach = "127.0.0.1"
    c.metrics_ports = []
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


def test_a_worker_whose_metrics_port_was_taken_restarts_on_a_free_one(monkeypatch, caplog):
    """Its old port, bound by something else since, would make it die again at every start."""
    def worker(role, port):
        return ["python", "-m", "baton.cli", "--log-level", "INFO", role, "--router", "x",
                "--model", "m", "--metrics-port", str(port)]

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        kept = local.free_port()
        c = cluster_of([FakeProc(["python", "-m", "baton.cli", "router"], 10),
                        FakeProc(worker("prefill-worker", kept), 11),
                        FakeProc(worker("decode-worker", taken), 12)])
        c.metrics_ports = [("prefill", kept), ("decode", taken)]
        started = []
        monkeypatch.setattr(c, "_popen", lambda cmd: started.append(cmd) or FakeProc(cmd, 99))
        caplog.set_level(logging.WARNING, logger="baton.serve")
        c.procs[1].returncode = c.procs[2].returncode = -9
        c.check_children(now=1.0)
        c.check_children(now=2.0)
    assert len(started) == 2
    assert started[0] == worker("prefill-worker", kept)  # still free: the same port
    fresh = int(started[1][-1])
    assert started[1][:-1] == worker("decode-worker", taken)[:-1] and fresh != taken
    assert c.metrics_ports == [("prefill", kept), ("decode", fresh)]
    assert (f"decode-worker's metrics port {taken} is taken now; it restarts with /metrics on "
            f"port {fresh}") in caplog.text
