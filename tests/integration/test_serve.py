"""`baton serve` as a user runs it: loopback router, its own cluster secret, SIGTERM ends all."""

from __future__ import annotations

import os
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
from tests.engine_helpers import make_checkpoint

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


def test_serve_binds_loopback_makes_a_secret_and_stops_on_sigterm_within_5s(tmp_path):
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
        (res,) = run_remote(f"127.0.0.1:{port}", [RequestSpec(
            "s1", prompt_ids=[5, 6, 7, 8], sampling=SamplingParams(max_tokens=4,
                                                                   ignore_eos=True))])
        assert len(res["token_ids"]) == 4, res
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # a secret is in force
            with pytest.raises(grpc.RpcError) as e:
                rgrpc.RegistryStub(ch).Deregister(
                    rpb.DeregisterRequest(worker_id="x"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for pid in procs:  # the secret travels in the environment, never on a command line
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"TOKEN" not in cmdline and b"--token" not in cmdline
            assert b"BATON_CLUSTER_TOKEN=" in Path(f"/proc/{pid}/environ").read_bytes()
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
    finally:
        for pid in [*(procs or children(serve.pid)), serve.pid]:  # none left behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        serve.wait(timeout=10)
        log.close()
