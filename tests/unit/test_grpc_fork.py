"""A child forked while a gRPC channel is busy starts its program (grpc/grpc#43055)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

FORKS = 300
RUN_FIRST = True  # tests/conftest.py: forks are cheap while the worker is small
ROOT = Path(__file__).resolve().parents[2]


def failed_children(n: int) -> int:
    """How many of `n` children forked beside a busy gRPC channel never ran their program.
    `preexec_fn` makes Popen fork (not vfork), as the multi-host harness's children do."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)
    stub.Check(health_pb2.HealthCheckRequest())
    done = threading.Event()

    def busy():
        while not done.is_set():
            stub.Check(health_pb2.HealthCheckRequest())

    spinner = threading.Thread(target=busy, daemon=True)
    spinner.start()
    try:
        codes = [subprocess.Popen(["true"], preexec_fn=lambda: None).wait() for _ in range(n)]
    finally:
        done.set()
        spinner.join(timeout=10)
        channel.close()
        server.stop(grace=None)
    return sum(c != 0 for c in codes)


def test_children_forked_beside_a_busy_channel_all_start_in_a_baton_process():
    """Without `GRPC_ENABLE_FORK_SUPPORT=false` (set by importing baton.startup, which every
    Baton entry point imports first) 2-3% of these children
    die before exec on grpcio 1.85, logging only `epoll_wait error: Bad file descriptor`."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    code = ("import baton.startup  # first, as in every Baton process\n"
            "from tests.unit.test_grpc_fork import failed_children\n"
            f"print(failed_children({FORKS}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0"], out.stderr[-2000:]
    assert "Bad file descriptor" not in out.stderr


def test_children_forked_by_the_test_process_all_start():
    """The harnesses (multi-host: `ip netns exec` with a parent-death signal) fork from here."""
    assert failed_children(FORKS) == 0
