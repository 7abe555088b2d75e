"""`baton serve` supervision: a dead process restarts after a doubling, logged backoff."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading

import pytest

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
    c._own_http = True
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


def worker_args(role, port):
    return ["python", "-m", "baton.cli", "--log-level", "INFO", role, "--router", "x",
            "--model", "m", "--metrics-port", str(port)]


class OneWorker:
    """The router's ListWorkers as `wait_ready` sees it: the workers of `procs` alive now."""

    def __init__(self, cluster):
        self.cluster = cluster

    def ListWorkers(self, request, timeout):
        alive = [p for p in self.cluster.procs[1:] if p.poll() is None]
        return type("Reply", (), {"workers": alive})


def waiting(c, monkeypatch):
    monkeypatch.setattr(c, "channel", lambda: contextlib.nullcontext(None))
    monkeypatch.setattr(local.router_pb2_grpc, "RouterStub", lambda ch: OneWorker(c))
    monkeypatch.setattr(c, "_http_ready", lambda: True)
    monkeypatch.setattr(local.time, "sleep", lambda s: None)


def test_a_worker_that_died_at_start_on_a_taken_metrics_port_starts_again_on_a_free_one(
        monkeypatch, caplog):
    """CI once lost a whole cluster this way: a port chosen for one worker was bound by
    another test's cluster before the worker (loading its model) got to bind it."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        c = cluster_of([FakeProc(["python", "-m", "baton.cli", "router"], 10),
                        FakeProc(worker_args("decode-worker", taken), 11)])
        c.metrics_ports, c.expected = [("decode", taken)], 1
        c.procs[1].returncode = 2
        started = []
        monkeypatch.setattr(c, "_popen", lambda cmd: started.append(cmd) or FakeProc(cmd, 99))
        waiting(c, monkeypatch)
        caplog.set_level(logging.WARNING, logger="baton.serve")
        c.wait_ready(timeout=10)
    (cmd,) = started
    fresh = int(cmd[-1])
    assert cmd[:-1] == worker_args("decode-worker", taken)[:-1] and fresh != taken
    assert c.metrics_ports == [("decode", fresh)] and c.restarts == [0, 1]
    assert c.procs[1].pid == 99
    assert (f"decode-worker's metrics port {taken} is taken now; it restarts with /metrics on "
            f"port {fresh}") in caplog.text


def test_a_process_that_died_at_start_with_its_ports_free_fails_the_start_at_once(monkeypatch):
    """Its error (a bad config, a missing model) is its own: a restart would only repeat it."""
    c = cluster_of([FakeProc(["python", "-m", "baton.cli", "router"], 10),
                    FakeProc(worker_args("prefill-worker", local.free_port()), 11)])
    c.procs[1].returncode = 2
    started = []
    monkeypatch.setattr(c, "_popen", lambda cmd: started.append(cmd) or FakeProc(cmd, 99))
    waiting(c, monkeypatch)
    with pytest.raises(local.BatonError, match=r"exited during start: \['prefill-worker "
                       r"--router'\]"):
        c.wait_ready(timeout=10)
    assert started == [] and c.restarts == [0, 0]


def test_ports_taken_at_every_start_fail_it_after_the_retries(monkeypatch):
    router = ["python", "-m", "baton.cli", "--log-level", "INFO", "router", "--port", "3",
              "--http-port", "1"]
    c = cluster_of([FakeProc(router, 10), FakeProc(worker_args("decode-worker", 2), 11)])
    c.metrics_ports = [("decode", 2)]
    c.http_port, c.http_address = 1, "http://127.0.0.1:1"
    for p in c.procs:
        p.returncode = 2

    def dead(cmd):
        p = FakeProc(cmd, 99)
        p.returncode = 2
        return p

    monkeypatch.setattr(c, "_popen", dead)
    monkeypatch.setattr(local, "port_is_free", lambda port, host: False)
    waiting(c, monkeypatch)
    with pytest.raises(local.BatonError, match=r"exited during start: \['router --port', "
                       r"'decode-worker --router'\]"):
        c.wait_ready(timeout=10)
    assert c.restarts == [local.START_RETRIES] * 2
    # the router's HTTP port moved with it (it was chosen here), as did the worker's metrics
    assert c.procs[0].args[-1] == str(c.http_port) != "1"
    assert c.http_address == f"http://127.0.0.1:{c.http_port}"
    assert c.metrics_ports == [("decode", int(c.procs[1].args[-1]))] != [("decode", 2)]


def test_a_configured_http_port_is_never_moved():
    c = cluster_of([FakeProc(["python", "-m", "baton.cli", "router", "--http-port", "1"], 10)])
    c._own_http = False
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        args = ["router", "--http-port", str(holder.getsockname()[1])]
        assert c._restart_args(0, list(args)) == args


PICKER = """
import sys
from baton.cluster import local
local.PICK_RANGE = (int(sys.argv[1]), int(sys.argv[1]) + 60)
local.RESERVATIONS = sys.argv[2]
print(" ".join(str(local.free_port()) for _ in range(15)))
"""


def test_free_port_never_hands_one_port_to_two_processes_on_the_host(tmp_path):
    """Two clusters starting at once (parallel tests) each pick ports their processes bind
    seconds later: a pick stays reserved for every caller on the host meanwhile."""
    lo = 21000
    procs = [subprocess.Popen([sys.executable, "-c", PICKER, str(lo), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    picks = [int(port) for p in procs for port in p.communicate(timeout=60)[0].split()]
    assert all(p.returncode == 0 for p in procs)
    assert len(picks) == 30 and len(set(picks)) == 30
    assert all(lo <= port < lo + 60 for port in picks)
    assert sorted(os.listdir(tmp_path)) == sorted(map(str, picks))


def test_a_reservation_lapses_after_reserve_s(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "RESERVATIONS", str(tmp_path / "r"))
    assert local._reserve(20001, now=1000.0)
    os.utime(tmp_path / "r" / "20001", (1000.0, 1000.0))
    assert not local._reserve(20001, now=1000.0 + local.RESERVE_S - 1)
    assert local._reserve(20001, now=1000.0 + local.RESERVE_S)  # stale: taken anew
    assert not local._reserve(20001, now=1000.0 + local.RESERVE_S + 1)
