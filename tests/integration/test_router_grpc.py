"""The router over real gRPC, with scripted in-process fake workers (tests/support/fake_workers.py)."""

from __future__ import annotations

import re
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from baton.config.router import RouterConfig
from baton.contract import Role, SnapshotEvent, WorkerLoad
from baton.contract.prefix_hash import snapshot_key
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import router_pb2_grpc as rgrpc
from bench.harness.fake_workers import Act, FakeWorker, Script, health_status
from router.server import run_router

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster():
    """cluster(config, p0=Script(), d0=Script(), ...) -> (router handle, stub, workers by id)."""
    started = []

    def start(config=None, **scripts):
        handle = run_router(0, config or RouterConfig())
        channel = grpc.insecure_channel(handle.address)
        workers = {}
        for wid, script in scripts.items():
            role = Role.PREFILL if wid.startswith("p") else Role.DECODE
            workers[wid] = FakeWorker(role, wid, script)
            workers[wid].register(handle.address)
        started.append((handle, channel, workers))
        return handle, rgrpc.RouterStub(channel), workers

    yield start
    for handle, channel, workers in started:
        channel.close()
        handle.stop(grace=None)
        for w in workers.values():
            w.stop()


def gen(stub, prompt_ids=(5, 6), request_id="r1", **sampling):
    req = rpb.GenerateRequest(
        request_id=request_id, prompt_ids=prompt_ids, sampling=pb.SamplingParams(**sampling)
    )
    return stub.Generate(req, timeout=10)


def worker_key(decode: FakeWorker) -> str:
    """The request's key on the workers (the router's own; the client's id is only a label)."""
    key = decode.calls("Reserve")[0][1]
    assert re.fullmatch(r"[0-9a-f]{32}", key), key
    return key


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_generate_streams_tokens_and_a_final_summary(cluster):
    handle, stub, w = cluster(p0=Script(cached_tokens=1), d0=Script())
    msgs = list(gen(stub, max_tokens=4))
    assert [list(m.token_ids) for m in msgs] == [[7], [8], [9], [10]]
    assert [m.finish_reason for m in msgs] == [0, 0, 0, pb.FINISH_REASON_LENGTH]
    last = msgs[-1]
    assert (last.request_id, last.prompt_tokens, last.cached_tokens) == ("r1", 2, 1)
    assert (last.prefill_worker, last.decode_worker, last.retries) == ("p0", "d0", 0)
    assert 0 < last.ttft_ms <= last.latency_ms
    assert w["d0"].state.held == {}


def test_stop_token_ends_with_stop(cluster):
    _, stub, _ = cluster(p0=Script(), d0=Script())
    msgs = list(gen(stub, max_tokens=50, stop_token_ids=[9]))
    assert [t for m in msgs for t in m.token_ids] == [7, 8, 9]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP


def test_no_worker_registered_is_unavailable(cluster):
    _, stub, _ = cluster()
    with pytest.raises(grpc.RpcError) as e:
        list(gen(stub))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no prefill worker available" in e.value.details()


def test_bad_sampling_is_invalid_argument_with_the_field_named(cluster):
    _, stub, w = cluster(p0=Script(), d0=Script())
    with pytest.raises(grpc.RpcError) as e:
        list(gen(stub, top_p=2.0))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "top_p must be in (0, 1], got 2.0"
    with pytest.raises(grpc.RpcError) as e:
        list(gen(stub, prompt_ids=()))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert w["d0"].calls() == []


def test_worker_invalid_argument_passes_through_unchanged_and_is_not_retried(cluster):
    _, stub, w = cluster(p0=Script(prefill=Act.INVALID), p1=Script(), d0=Script())
    with pytest.raises(grpc.RpcError) as e:
        list(gen(stub))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "p0: prompt too long"
    assert w["p1"].calls() == []
    key = worker_key(w["d0"])
    assert w["d0"].calls("Abort") == [("Abort", key)]
    assert w["d0"].state.held == {}


def test_failure_before_first_token_retries_on_another_pair(cluster):
    _, stub, w = cluster(p0=Script(prefill=Act.FAIL), p1=Script(), d0=Script(), d1=Script())
    msgs = list(gen(stub, max_tokens=3))
    last = msgs[-1]
    assert [t for m in msgs for t in m.token_ids] == [7, 8, 9]
    assert (last.prefill_worker, last.decode_worker, last.retries) == ("p1", "d1", 1)
    key = worker_key(w["d0"])
    assert w["p0"].calls() == [("Prefill", key), ("Abort", key)]
    assert w["d0"].calls() == [("Reserve", key), ("Abort", key)]
    assert w["d1"].calls("Reserve") == [("Reserve", f"{key}~retry1")]
    assert w["d0"].state.held == {} and w["d1"].state.held == {}


def test_full_workers_are_retried_and_all_full_is_resource_exhausted(cluster):
    _, stub, w = cluster(p0=Script(), d0=Script(reserve=Act.FULL), d1=Script())
    assert list(gen(stub, max_tokens=2))[-1].decode_worker == "d1"
    # every decode worker full: the request waits in the router's queue, then gets 429
    config = RouterConfig(queue_timeout_s=0.3)
    _, stub, w = cluster(config, p0=Script(), d0=Script(reserve=Act.FULL),
                         d1=Script(reserve=Act.FULL))
    with pytest.raises(grpc.RpcError) as e:
        list(gen(stub))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "router.queue_timeout_s" in e.value.details()


def test_decode_failure_after_first_token_moves_the_request_to_a_new_pair(cluster):
    """d0 dies after streaming 2 tokens: a new pair prefills prompt + those tokens and the
    client's stream goes on with the rest of max_tokens, counted once in the summary."""
    _, stub, w = cluster(p0=Script(), d0=Script(decode=Act.FAIL_MID), d1=Script())
    msgs = list(gen(stub, max_tokens=10))
    assert [t for m in msgs for t in m.token_ids] == list(range(7, 17))
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.prompt_tokens, last.decode_worker, last.retries) == (2, "d1", 1)
    key = worker_key(w["d0"])
    assert w["p0"].calls("Prefill") == [("Prefill", key), ("Prefill", f"{key}~move1")]
    assert w["d1"].calls("Reserve") == [("Reserve", f"{key}~move1")]
    assert w["d1"].servicer.sampling[f"{key}~move1"].max_tokens == 8
    assert ("Abort", key) in w["d0"].calls()
    assert w["d0"].state.held == {} and w["d1"].state.held == {}


def test_decode_failure_with_no_decode_worker_left_fails_the_stream(cluster):
    _, stub, w = cluster(p0=Script(), d0=Script(decode=Act.FAIL_MID))
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for m in gen(stub, max_tokens=10):
            got.extend(m.token_ids)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker d0 failed Decode: UNAVAILABLE: d0: scripted failure; moving the request " \
           "failed: no decode worker available" in e.value.details()
    assert got == [7, 8]
    key = worker_key(w["d0"])
    assert wait_for(lambda: ("Abort", key) in w["p0"].calls())
    assert ("Abort", key) in w["d0"].calls()


def test_a_dead_decode_worker_cancels_the_prefill_working_for_it_within_a_second(cluster):
    """d0's process dies while p0 computes for it: the router finds nothing listening at d0's
    address, drops d0 and cancels p0's call at once (not at lease expiry or ejection)."""
    handle, stub, w = cluster(p0=Script(prefill=Act.HANG, hang_limit_s=20), d0=Script())
    call = gen(stub, max_tokens=3)
    assert wait_for(lambda: w["p0"].calls("Prefill"))
    key = worker_key(w["d0"])
    start = time.monotonic()
    w["d0"].server.stop(None)  # as a killed process: its port closes, its connections drop
    assert wait_for(lambda: w["p0"].state.wake[key].is_set(), timeout=5)
    cancelled = time.monotonic() - start
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert cancelled < 1.0, cancelled
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert e.value.details() == "no decode worker available"  # the retry found d0 gone
    assert handle.registry.get("d0") is None and handle.registry.ejected == 1
    assert wait_for(lambda: ("Abort", key) in w["p0"].calls())


@pytest.mark.parametrize("hang", ["prefill", "decode"])
def test_client_cancel_propagates_abort_to_both_workers(cluster, hang):
    scripts = {"p0": Script(), "d0": Script()}
    if hang == "prefill":
        scripts["p0"] = Script(prefill=Act.HANG)
    else:
        scripts["d0"] = Script(decode=Act.HANG)
    handle, stub, w = cluster(**scripts)
    call = gen(stub, max_tokens=10)
    method = "Prefill" if hang == "prefill" else "Decode"
    target = w["p0"] if hang == "prefill" else w["d0"]
    assert wait_for(lambda: target.calls(method))
    if hang == "decode":
        assert list(next(call).token_ids) == [7]
    call.cancel()
    key = worker_key(w["d0"])
    assert wait_for(lambda: ("Abort", key) in w["p0"].calls())
    assert wait_for(lambda: ("Abort", key) in w["d0"].calls())
    assert w["d0"].state.held == {}
    assert wait_for(lambda: handle.registry.get("p0").inflight == 0)


def test_silent_worker_is_ejected_and_heartbeat_asks_it_to_reregister(cluster):
    config = RouterConfig(heartbeat_seconds=0.05, eject_after_seconds=0.3)
    handle, stub, w = cluster(config, p0=Script(), d0=Script())
    listed = stub.ListWorkers(rpb.ListWorkersRequest(role=pb.WORKER_ROLE_PREFILL))
    assert [x.worker_id for x in listed.workers] == ["p0"]
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # d0 heartbeats, p0 stays silent
        assert not w["d0"].heartbeat(WorkerLoad(running=1)).reregister
        time.sleep(0.05)
    workers = stub.ListWorkers(rpb.ListWorkersRequest()).workers
    assert [(x.worker_id, x.load.running) for x in workers] == [("d0", 1)]
    with pytest.raises(grpc.RpcError) as e:
        list(gen(stub))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert w["p0"].heartbeat().reregister
    w["p0"].register(handle.address)
    names = [x.worker_id for x in stub.ListWorkers(rpb.ListWorkersRequest()).workers]
    assert names == ["d0", "p0"]


def test_prefix_aware_routes_to_the_worker_whose_snapshot_covers_the_prompt(cluster):
    config = RouterConfig(policy="prefix_aware")
    handle, stub, w = cluster(config, p0=Script(), p1=Script(), d0=Script())
    prompt = tuple(range(1, 50))
    key = snapshot_key(prompt, 32, 16)
    w["p1"].heartbeat(WorkerLoad(running=1), (SnapshotEvent(True, *key),))
    assert list(gen(stub, prompt_ids=prompt, max_tokens=1))[-1].prefill_worker == "p1"
    listed = {
        x.worker_id: x.tracked_snapshots for x in stub.ListWorkers(rpb.ListWorkersRequest()).workers
    }
    assert listed == {"p0": 0, "p1": 1, "d0": 0}
    w["p1"].heartbeat(WorkerLoad(running=1), (SnapshotEvent(False, *key),))
    assert list(gen(stub, prompt_ids=prompt, max_tokens=1))[-1].prefill_worker == "p0"


def test_health_is_served_for_the_router_services(cluster):
    handle, _, _ = cluster()
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", "baton.v1.Router", "baton.v1.Registry"):
        assert health_status(handle.address, service) == serving


def test_concurrent_requests_all_finish_and_spread_over_workers(cluster):
    from concurrent.futures import ThreadPoolExecutor

    config = RouterConfig(policy="least_loaded")
    # The 8 decode streams wait for each other before their first token, so all 8 are in
    # flight together whatever the machine's load: on a starved CI machine (the step kernels
    # compiling beside the tests) each had finished before the next was routed, all to the
    # tie's d0, even at 0.25 s a request.
    gate = threading.Barrier(8)
    scripts = {w: Script(token_delay_s=0.05, decode_gate=gate if w[0] == "d" else None)
               for w in ("p0", "p1", "d0", "d1")}
    _, stub, w = cluster(config, **scripts)

    def one(i):
        msgs = list(gen(stub, prompt_ids=(i,), request_id=f"r{i}", max_tokens=5))
        return [t for m in msgs for t in m.token_ids], msgs[-1].decode_worker

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(100, 108)))
    assert [tokens for tokens, _ in results] == [list(range(i + 1, i + 6)) for i in range(100, 108)]
    assert {d for _, d in results} == {"d0", "d1"}
    assert w["d0"].state.held == {} and w["d1"].state.held == {}


def test_two_requests_with_the_same_id_both_get_their_answers(cluster):
    """Two clients that both say `req-1` (two `baton generate` runs do) are two requests:
    both answered in full, nothing refused, nothing aborted."""
    from concurrent.futures import ThreadPoolExecutor

    scripts = {w: Script(token_delay_s=0.05) for w in ("p0", "d0")}  # the streams overlap
    _, stub, w = cluster(**scripts)

    def one(prompt):
        msgs = list(gen(stub, prompt_ids=prompt, request_id="req-1", max_tokens=6))
        return [t for m in msgs for t in m.token_ids], {m.request_id for m in msgs}

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(one, [(10,), (50,)])
    assert a == ([11, 12, 13, 14, 15, 16], {"req-1"})
    assert b == ([51, 52, 53, 54, 55, 56], {"req-1"})
    keys = {rid for _, rid in w["d0"].calls("Reserve")}
    assert len(keys) == 2 and "req-1" not in keys
    assert {rid for _, rid in w["d0"].calls("Decode")} == keys
    assert w["p0"].calls("Abort") == w["d0"].calls("Abort") == []
    assert w["d0"].state.held == {}


def test_full_decode_workers_queue_requests_in_arrival_order(cluster):
    """One decode worker that holds one request at a time: six requests sent 60 ms apart all
    get their answers, decoded one after another in the order they arrived."""
    import threading

    handle, stub, w = cluster(p0=Script(), d0=Script(capacity=1, token_delay_s=0.05))
    results, done, threads = {}, [], []
    for i in range(6):
        def one(i=i):
            msgs = list(gen(stub, prompt_ids=(10 * i,), request_id=f"q{i}", max_tokens=4))
            results[i] = [t for m in msgs for t in m.token_ids]
            done.append(i)

        threads.append(threading.Thread(target=one))
        threads[-1].start()
        time.sleep(0.06)
    for t in threads:
        t.join(20)
    assert results == {i: [10 * i + k for k in range(1, 5)] for i in range(6)}
    assert done == list(range(6))  # one at a time, in arrival order
    assert len(w["d0"].calls("Decode")) == 6 and w["d0"].state.max_held == 1
    assert w["d0"].state.held == {} and handle.orchestrator.queue.waiting == 0


def test_queue_full_and_queue_timeout_are_resource_exhausted(cluster):
    import threading

    config = RouterConfig(max_queued_requests=1, queue_timeout_s=0.4)
    handle, stub, w = cluster(config, p0=Script(), d0=Script(capacity=1, token_delay_s=0.15))
    first = {}
    runner = threading.Thread(target=lambda: first.update(
        msgs=list(gen(stub, prompt_ids=(1,), request_id="busy", max_tokens=10))))
    runner.start()
    assert wait_for(lambda: w["d0"].calls("Decode"))
    errors = {}

    def queued():
        with pytest.raises(grpc.RpcError) as e:
            list(gen(stub, prompt_ids=(2,), request_id="waits", max_tokens=2))
        errors["waits"] = e.value

    waiter = threading.Thread(target=queued)
    t0 = time.monotonic()
    waiter.start()
    assert wait_for(lambda: handle.orchestrator.queue.waiting == 1)
    with pytest.raises(grpc.RpcError) as e:
        list(gen(stub, prompt_ids=(3,), request_id="refused", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.value.details() == (
        "every decode worker is full and the router queue holds 1 requests "
        "(router.max_queued_requests=1); retry later")
    waiter.join(10)
    assert 0.4 <= time.monotonic() - t0 < 5.0
    assert errors["waits"].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waited 0.4s in the router queue" in errors["waits"].details()
    assert "router.queue_timeout_s" in errors["waits"].details()
    runner.join(10)
    assert [t for m in first["msgs"] for t in m.token_ids] == list(range(2, 12))
    assert w["d0"].state.held == {} and handle.orchestrator.queue.waiting == 0


@pytest.mark.parametrize("prompt_len, max_tokens, needle", [
    (64, 1, "prompt has 64 tokens but the max model length is 64 (prompt + at least one "
            "output token); shorten the prompt"),
    (10, 60, "prompt (10 tokens) + max_tokens (60) is 70 tokens, beyond the max model length "
             "64; lower max_tokens to at most 54 or shorten the prompt"),
    (10, 2**32 - 1, "lower max_tokens to at most 54"),
])
def test_what_no_worker_can_take_is_invalid_before_any_worker_call(
        cluster, prompt_len, max_tokens, needle):
    handle, stub, w = cluster(p0=Script(), d0=Script())
    for wid in ("p0", "d0"):
        w[wid].register(handle.address, WorkerLoad(total_blocks=64), max_model_len=64)
    with pytest.raises(grpc.RpcError) as e:
        list(gen(stub, prompt_ids=(5,) * prompt_len, max_tokens=max_tokens))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == needle if needle.startswith("prompt") else \
        needle in e.value.details()
    assert w["p0"].calls() == w["d0"].calls() == []


def test_a_prompt_larger_than_any_pool_is_invalid(cluster):
    handle, stub, w = cluster(p0=Script(), d0=Script())
    w["d0"].register(handle.address, WorkerLoad(total_blocks=4), max_model_len=4096)
    with pytest.raises(grpc.RpcError) as e:
        list(gen(stub, prompt_ids=(5,) * 60, max_tokens=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        "prompt + max_tokens (65 tokens) needs 5 KV blocks of 16 tokens but a worker's whole "
        "pool has 4 (cache.num_blocks); shorten the prompt or lower max_tokens")
    assert w["d0"].calls() == []


def test_undecodable_requests_are_invalid_argument(cluster):
    handle, _, _ = cluster(p0=Script(), d0=Script())
    with grpc.insecure_channel(handle.address) as ch:
        for method, streaming in (("/baton.v1.Router/Generate", True),
                                  ("/baton.v1.Registry/Register", False)):
            call = (ch.unary_stream if streaming else ch.unary_unary)(
                method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as e:
                result = call(b"\xff\xff\xff\xff", timeout=5)
                list(result) if streaming else result
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert f"the request to {method} is not a valid message" in e.value.details()


def test_a_text_prompt_over_the_byte_limit_is_refused_before_tokenizing():
    encoded = []

    class Tok:
        def encode(self, text):
            encoded.append(text)
            return [ord(c) % 200 for c in text]

        def decode(self, ids):
            return ""

    handle = run_router(0, RouterConfig(max_prompt_bytes=100), Tok())
    try:
        with grpc.insecure_channel(handle.address) as ch:
            stub = rgrpc.RouterStub(ch)
            req = rpb.GenerateRequest(request_id="big", prompt="é" * 51)  # 102 UTF-8 bytes
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=5))
    finally:
        handle.stop(grace=None)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == ("prompt text is 102 bytes, over the router's limit of 100 "
                                 "(router.max_prompt_bytes); shorten it")
    assert encoded == []


def test_a_router_on_every_interface_without_api_keys_warns(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="router.server"):
        handle = run_router(0, RouterConfig(host="0.0.0.0"))
        handle.stop(grace=None)
        quiet = run_router(0, RouterConfig(host="127.0.0.1"))
        quiet.stop(grace=None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"the router listens on 0.0.0.0 without API keys: anyone who reaches port "
        f"{handle.port} can run requests; set router.api_keys_file or BATON_API_KEY, or "
        f"router.host: 127.0.0.1"
    ]


def test_the_command_line_client_sends_baton_api_key(monkeypatch):
    from baton.client.remote import run_remote
    from baton.client.requests import RequestSpec
    from baton.engine.request import SamplingParams

    handle = run_router(0, RouterConfig(host="127.0.0.1"), api_keys=frozenset({"key-1234567"}))
    p0, d0 = FakeWorker(Role.PREFILL, "p0"), FakeWorker(Role.DECODE, "d0")
    try:
        p0.register(handle.address)
        d0.register(handle.address)
        spec = RequestSpec("c1", prompt_ids=[5], sampling=SamplingParams(max_tokens=2))
        monkeypatch.delenv("BATON_API_KEY", raising=False)
        (refused,) = run_remote(handle.address, [spec])
        monkeypatch.setenv("BATON_API_KEY", "key-1234567")
        (ok,) = run_remote(handle.address, [spec])
    finally:
        handle.stop(grace=None)
        p0.stop()
        d0.stop()
    assert refused["error"].startswith("UNAUTHENTICATED: baton.v1.Router needs credentials")
    assert ok["token_ids"] == [6, 7]


class KeepAlive:
    """Heartbeats `workers` every 50 ms until closed (the others fall silent)."""

    def __init__(self, *workers: FakeWorker):
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(workers,), daemon=True)
        self._thread.start()

    def _run(self, workers) -> None:
        while not self._stop.wait(0.05):
            for w in workers:
                w.heartbeat()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_a_decode_worker_that_falls_silent_mid_stream_fails_its_stream_at_ejection(cluster):
    """A host whose link went down answers nothing: the stream must end when the router
    ejects the worker, not when TCP gives up (here: long after d0's 8 s hang)."""
    config = RouterConfig(heartbeat_seconds=0.05, eject_after_seconds=0.5)
    handle, stub, w = cluster(config, p0=Script(), d0=Script(decode=Act.HANG, hang_limit_s=8))
    got = []
    with KeepAlive(w["p0"]), pytest.raises(grpc.RpcError) as e:
        call = gen(stub, max_tokens=10)
        got.extend(next(call).token_ids)
        start = time.monotonic()
        for m in call:
            got.extend(m.token_ids)
    waited = time.monotonic() - start
    assert got == [7, 8]  # the prefill's token, then d0's first before it hung
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker d0 failed Decode: it was ejected: no heartbeat for 0.5 s" in e.value.details()
    assert 0.4 < waited < 2.0, waited
    assert handle.registry.ejected == 1


def test_a_prefill_worker_that_falls_silent_is_ejected_and_the_request_retried(cluster):
    config = RouterConfig(heartbeat_seconds=0.05, eject_after_seconds=0.5)
    handle, stub, w = cluster(config, p0=Script(prefill=Act.HANG, hang_limit_s=8), d0=Script())
    p1 = FakeWorker(Role.PREFILL, "p1", Script())
    try:
        with KeepAlive(w["d0"], p1):
            call = gen(stub, max_tokens=3)
            assert wait_for(lambda: w["p0"].calls("Prefill"))  # p0 took it, then went silent
            p1.register(handle.address)
            start = time.monotonic()
            msgs = list(call)
            waited = time.monotonic() - start
    finally:
        p1.stop()
    assert [t for m in msgs for t in m.token_ids] == [7, 8, 9]
    assert (msgs[-1].prefill_worker, msgs[-1].decode_worker, msgs[-1].retries) == ("p1", "d0", 1)
    assert waited < 2.0, waited
    assert [c for c in w["d0"].calls() if c[0] == "Abort"] == [("Abort", worker_key(w["d0"]))]
    assert w["d0"].state.held == {}
