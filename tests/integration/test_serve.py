"""`baton serve` as a user runs it: loopback router, its own cluster secret, SIGTERM ends all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from baton.client.remote import run_remote
from baton.client.requests import RequestSpec
from baton.cluster.local import free_port
from baton.engine.request import SamplingParams
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import router_pb2_grpc as rgrpc
from tests.support.engine_helpers import make_checkpoint

pytestmark = pytest.mark.integration


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def role_of(pid: int) -> str | None:
    """The role on `pid`'s command line; None for a process without one (a worker being
    restarted is, between its fork and its exec, a copy of `serve`) or one gone."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((a.decode() for a in args if a in (b"router", b"prefill-worker",
                                                   b"decode-worker")), None)


def test_serve_binds_loopback_makes_a_secret_restarts_the_dead_and_stops_on_sigterm_within_5s(
        tmp_path):
    model = make_checkpoint(tmp_path)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("BATON_CLUSTER_TOKEN",
                                                             "BATON_API_KEY")}
    log = (tmp_path / "serve.log").open("w+")
    serve = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "--log-level", "INFO", "serve", "--model",
         str(model), "--port", str(port), "--http-port", "0"],
        stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)
    procs: list[int] = []
    try:
        banner = serve.stdout.readline()
        assert banner.startswith(f"baton cluster ready: router gRPC at 127.0.0.1:{port}"), banner
        procs = children(serve.pid)
        assert len(procs) == 3
        (first,) = run_remote(f"127.0.0.1:{port}", [RequestSpec(
            "s1", prompt_ids=[5, 6, 7, 8], sampling=SamplingParams(max_tokens=4,
                                                                   ignore_eos=True))])
        assert len(first["token_ids"]) == 4, first
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # a secret is in force
            with pytest.raises(grpc.RpcError) as e:
                rgrpc.RegistryStub(ch).Deregister(
                    rpb.DeregisterRequest(worker_id="x"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for pid in procs:  # the secret travels in the environment, never on a command line
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"TOKEN" not in cmdline and b"--token" not in cmdline
            assert b"BATON_CLUSTER_TOKEN=" in Path(f"/proc/{pid}/environ").read_bytes()
        # supervision: a killed decode worker is started again and the cluster goes on serving
        victim = next(p for p in procs if role_of(p) == "decode-worker")
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        roles = ["decode-worker", "prefill-worker", "router"]
        while time.monotonic() < deadline:
            procs = children(serve.pid)
            if (len(procs) == 3 and victim not in procs
                    and sorted(map(str, map(role_of, procs))) == roles):
                break  # (a restarted worker has its role once it has exec'd)
            time.sleep(0.1)
        # on failure, what serve and its workers said is the evidence (read through a file of
        # its own: `log`'s offset is the one the processes write at)
        assert sorted(map(str, map(role_of, procs))) == roles, \
            (tmp_path / "serve.log").read_text()[-6000:]
        reborn = next(p for p in procs if role_of(p) == "decode-worker")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            while time.monotonic() < deadline:  # registered under its new id (pid in it)
                ids = [w.worker_id for w in rgrpc.RouterStub(ch).ListWorkers(
                    rpb.ListWorkersRequest(), timeout=5).workers]
                if any(f"-{reborn}-" in w for w in ids) and len(ids) == 2:
                    break
                time.sleep(0.1)
        assert len(ids) == 2 and any(f"-{reborn}-" in w for w in ids), ids
        (res,) = run_remote(f"127.0.0.1:{port}", [RequestSpec(
            "s2", prompt_ids=[5, 6, 7, 8], sampling=SamplingParams(max_tokens=4,
                                                                   ignore_eos=True))])
        assert res.get("token_ids") == first["token_ids"], res  # the new worker, same tokens
        t0 = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=10)
        while any(alive(p) for p in procs) and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert not any(alive(p) for p in procs)
        assert took < 5.0, f"baton serve took {took:.1f}s to stop after SIGTERM"
        assert serve.returncode == 0
        log.seek(0)
        text = log.read()
        assert f"router serving gRPC on 127.0.0.1:{port} and HTTP on http://127.0.0.1:" in text
        assert "killing it" not in text  # every process stopped by itself
        assert f"decode-worker (pid {victim}) exited with code -9" in text
        assert "restarting it in 0.5s" in text and "restarted decode-worker as pid" in text
    finally:
        for pid in [*(procs or children(serve.pid)), serve.pid]:  # none left behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        serve.wait(timeout=10)
        log.close()


def test_serve_port_0_picks_one_free_port_that_the_workers_find(tmp_path):
    model = make_checkpoint(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("BATON_CLUSTER_TOKEN",
                                                             "BATON_API_KEY")}
    serve = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "serve", "--model",
         str(model), "--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        start_new_session=True)
    try:
        banner = serve.stdout.readline()
        found = re.match(r"baton cluster ready: router gRPC at 127\.0\.0\.1:(\d+), ", banner)
        assert found and int(found[1]) > 0, banner
        (res,) = run_remote(f"127.0.0.1:{found[1]}", [RequestSpec(
            "z1", prompt_ids=[5, 6, 7, 8], sampling=SamplingParams(max_tokens=4,
                                                                   ignore_eos=True))])
        assert len(res["token_ids"]) == 4, res
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=10) == 0
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(timeout=10)


def test_a_worker_told_router_port_0_fails_at_once_naming_it(tmp_path):
    model = make_checkpoint(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli", "decode-worker", "--router", "127.0.0.1:0",
         "--model", str(model)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--router 127.0.0.1:0: port 0 is no router's address (give its port)" in out.stderr
