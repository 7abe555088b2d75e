"""The router's Decode/Serve streams let go of their gRPC call however they end.

A single-threaded stream (router/worker_client.py CHANNEL_OPTIONS) has no channel thread to
complete it: a call whose events this thread did not all take keeps its C call, completion
queue and Python state in the channel for good. Cancelled streams did (~1 KiB each, forever):
a client that disconnects, a stop string, a deadline. This test counts gRPC's own call
states, so it also fails if a gRPC release changes the internals `_drain` relies on.
"""

from __future__ import annotations

import gc
import threading

import pytest

from baton.config.router import RouterConfig
from baton.contract import ReserveInput, Role, SamplingParams, WorkerLoad, WorkerView
from baton.errors import RequestCancelled
from bench.harness.fake_workers import FakeWorker, Script
from router.cancellation import Cancellation
from router.worker_client import WorkerClients

N = 12
MAX_TOKENS = 10_000  # never reached: every stream here ends early unless read to its end


def call_states() -> int:
    """gRPC call states alive in this process (cygrpc `_CallState`, one per call)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__ == "_CallState")


@pytest.fixture
def decode():
    worker = FakeWorker(Role.DECODE, "d0", Script(token_delay_s=0.002))
    clients = WorkerClients(RouterConfig())
    client = clients(WorkerView("d0", Role.DECODE, worker.address, 16, WorkerLoad(), 0))

    def start(rid: str, max_tokens: int = MAX_TOKENS, cancel: Cancellation | None = None):
        client.reserve(ReserveInput(rid, (5, 6, 7), SamplingParams(max_tokens=max_tokens)),
                       Cancellation())
        return client.decode(rid, 8, cancel or Cancellation())

    start("warm-up", max_tokens=3).close()  # the channel connects: its own state is not ours
    list(start("warm-up-2", max_tokens=3))
    yield start, clients
    clients.close()
    worker.server.stop(None)


def test_streams_cancelled_by_the_client_leave_no_call_behind(decode):
    start, clients = decode
    before = call_states()
    for i in range(N):
        cancel = Cancellation()
        stream = start(f"c{i}", cancel=cancel)
        next(stream)
        threading.Timer(0.01, cancel.cancel).start()  # while the reader waits for a message
        with pytest.raises(RequestCancelled):
            for _ in stream:
                pass
    assert call_states() == before
    assert clients.calls.snapshot() == {"worker_streams": 0, "prefill_calls": 0}


def test_streams_closed_mid_way_leave_no_call_behind(decode):
    """The consumer stops (a stop string, a client gone between two chunks): the stream's
    generator is closed at a chunk; it cancels the call and takes its last events."""
    start, clients = decode
    before = call_states()
    for i in range(N):
        stream = start(f"s{i}")
        for _ in range(i % 3 + 1):
            next(stream)
        stream.close()
    assert call_states() == before
    assert clients.calls.snapshot() == {"worker_streams": 0, "prefill_calls": 0}


def test_streams_read_to_their_end_leave_no_call_behind(decode):
    start, clients = decode
    before = call_states()
    for i in range(N):
        chunks = list(start(f"f{i}", max_tokens=4))
        assert [t for c in chunks for t in c.token_ids] == [9, 10, 11]
    assert call_states() == before
    assert clients.calls.snapshot() == {"worker_streams": 0, "prefill_calls": 0}
