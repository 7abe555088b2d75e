"""Fuzzing a running cluster (router + 1 prefill + 1 decode worker, real processes, with a cluster
secret and an API key) as an authenticated but hostile client would.

Router gRPC, the HTTP API, both worker services (with the cluster secret) and the decode
worker's ZeroMQ side channel (sealed with the secret) each get thousands of cases: protobuf
messages with hostile field values (huge, negative, NaN, unicode, empty, very long, wrong ids,
forged block lists) and raw mutated bytes. Every answer is OK or a client-error status
(tests/support/fuzz.py: never INTERNAL, UNKNOWN or UNAVAILABLE; HTTP never 5xx); no process
dies; afterwards a normal request gives the colocated engine's tokens and nothing is leaked.
Cases are derandomized (the same in every run) and bounded for CI time.
"""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from baton.auth.grpc_auth import authorized
from baton.contract import ReserveInput, wire
from baton.engine.request import SamplingParams
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import router_pb2_grpc as rgrpc
from baton.proto_gen import worker_pb2 as wpb
from baton.proto_gen import worker_pb2_grpc as wgrpc
from tests.engine_helpers import make_checkpoint, prompt
from tests.integration.cluster_helpers import start_cluster, write_config
from tests.support import fuzz
from tests.support.fuzz import (
    CLIENT_ERRORS,
    INT32,
    UINT32,
    UINT64,
    fuzz_settings,
    hostile_float,
    hostile_int,
    hostile_text,
    mutated,
)

pytestmark = pytest.mark.integration

API_KEY = "fuzz-public-api-key"
MAX_MODEL_LEN = 40
VOCAB = 512
"""The tiny checkpoint's."""
CONFIG = {
    "cache": {"num_blocks": 96, "num_state_slots": 24},
    "worker": {"max_num_seqs": 8, "max_model_len": MAX_MODEL_LEN},
    "router": {"heartbeat_seconds": 0.5, "eject_after_seconds": 30.0, "queue_timeout_s": 2.0},
    "transfer": {"lease_seconds": 5.0},
}
CASES = 1000
"""Per test; the router API (gRPC + HTTP), the worker APIs (prefill + decode) and the side
channel get 2,000 cases each."""
SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model = make_checkpoint(root)
    (root / "keys").write_text(API_KEY + "\n")
    cfg = {**CONFIG, "router": {**CONFIG["router"], "api_keys_file": str(root / "keys")}}
    cluster = start_cluster(model, write_config(root / "baton.yaml", cfg), prefill=1, decode=1)
    bearer = cluster.secret.bearer
    channels = {"router": authorized(grpc.insecure_channel(cluster.address), API_KEY),
                "registry": authorized(grpc.insecure_channel(cluster.address), bearer)}
    try:
        listed = rgrpc.RouterStub(channels["router"]).ListWorkers(rpb.ListWorkersRequest(),
                                                                   timeout=5)
        for w in listed.workers:
            role = "prefill" if w.role == pb.WORKER_ROLE_PREFILL else "decode"
            channels[role] = authorized(grpc.insecure_channel(w.address), bearer)
        yield {"cluster": cluster, "model": model, "channels": channels,
               "ids": [w.worker_id for w in listed.workers]}
    finally:
        for ch in channels.values():
            ch.close()
        cluster.stop()


def alive(setup) -> None:
    dead = [p.args for p in setup["cluster"].procs if p.poll() is not None]
    assert not dead, f"cluster processes died: {dead}"


def status_of_call(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def check(code: grpc.StatusCode, what) -> None:
    assert code == grpc.StatusCode.OK or code in CLIENT_ERRORS, (code, what)


def raw(channel: grpc.Channel, method: str, kind: str = "unary_unary"):
    """`method` taking and returning raw bytes (what a hostile client can send)."""
    return getattr(channel, kind)(method, request_serializer=None, response_deserializer=None)


# ---- strategies: protobuf messages with hostile field values ------------------------------

def sampling() -> st.SearchStrategy[pb.SamplingParams]:
    opt = st.none().__or__
    return st.builds(
        lambda mt, t, p, k, s, stops, eos: pb.SamplingParams(
            max_tokens=mt, temperature=t, top_p=p, top_k=k, seed=s, stop_token_ids=stops,
            ignore_eos=eos),
        opt(hostile_int(*UINT32)), opt(hostile_float()), opt(hostile_float()),
        opt(hostile_int(*UINT32)), opt(hostile_int(*UINT64)),
        st.lists(hostile_int(*INT32), max_size=4), st.booleans())


def token_ids() -> st.SearchStrategy[list[int]]:
    return fuzz.token_ids(VOCAB, MAX_MODEL_LEN)


def maybe(strategy):
    return st.one_of(st.none(), strategy)


@st.composite
def generate_requests(draw) -> bytes:
    m = rpb.GenerateRequest(request_id=draw(hostile_text()), session_id=draw(hostile_text()))
    if draw(st.booleans()):
        m.prompt_ids.extend(draw(token_ids()))
    else:
        m.prompt = draw(hostile_text(60))
    if draw(st.booleans()):
        m.sampling.CopyFrom(draw(sampling()))
    return m.SerializeToString()


VALID_GENERATE = rpb.GenerateRequest(
    request_id="r", prompt_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=2)
).SerializeToString()


def consume_first(call) -> None:
    """Reads a stream's first message, then cancels: accepted requests cost one prefill."""
    try:
        next(call)
    except StopIteration:
        return
    call.cancel()


# ---- Router: Generate, ListWorkers, Registry ----------------------------------------------

@fuzz_settings(CASES)
@given(data=st.one_of(generate_requests(), mutated(VALID_GENERATE)))
@example(data=rpb.GenerateRequest(prompt_ids=[5, 6], sampling=pb.SamplingParams(
    temperature=float("nan"))).SerializeToString())
def test_router_generate_fuzz(setup, data):
    generate = raw(setup["channels"]["router"], "/baton.v1.Router/Generate", "unary_stream")
    check(status_of_call(lambda: consume_first(generate(data, timeout=TIMEOUT))), data[:200])


@st.composite
def registry_calls(draw) -> tuple[str, bytes]:
    """Register / Heartbeat / Deregister / ListWorkers with hostile values; worker ids are
    never the live workers' (an insider may re-register those)."""
    wid = "fuzz-" + draw(hostile_text())
    load = pb.WorkerLoad(**{k: draw(hostile_int(*UINT32)) for k in (
        "running", "waiting", "free_blocks", "free_slots", "total_blocks", "total_slots")})
    which = draw(st.sampled_from(["Register", "Heartbeat", "Deregister", "ListWorkers"]))
    if which == "Register":
        m = rpb.RegisterRequest(worker_id=wid, role=draw(hostile_int(*INT32)),
                                address=draw(hostile_text()), load=load,
                                tokens_per_block=draw(hostile_int(*UINT32)),
                                max_model_len=draw(hostile_int(*UINT32)))
    elif which == "Heartbeat":
        events = [pb.SnapshotEvent(kind=draw(hostile_int(*INT32)),
                                   block_hash=draw(hostile_int(*UINT64)),
                                   snapshot_hash=draw(hostile_int(*UINT64)),
                                   num_tokens=draw(hostile_int(*UINT32)))
                  for _ in range(draw(st.integers(0, 3)))]
        m = rpb.HeartbeatRequest(worker_id=wid, load=load, snapshot_events=events)
    elif which == "Deregister":
        m = rpb.DeregisterRequest(worker_id=wid)
    else:
        m = rpb.ListWorkersRequest(role=draw(hostile_int(*INT32)))
    data = m.SerializeToString()
    if draw(st.integers(0, 3)) == 0:
        data = draw(mutated(data))
    service = "Router" if which == "ListWorkers" else "Registry"
    return f"/baton.v1.{service}/{which}", data


@fuzz_settings(CASES // 2)
@given(call=registry_calls())
@example(call=("/baton.v1.Router/ListWorkers", rpb.ListWorkersRequest(role=7).SerializeToString()))
@example(call=("/baton.v1.Registry/Register", rpb.RegisterRequest(
    worker_id="fuzz-x", role=pb.WORKER_ROLE_DECODE, address="",
    tokens_per_block=0).SerializeToString()))
def test_router_registry_and_list_fuzz(setup, call):
    method, data = call
    channel = setup["channels"]["router" if "Router" in method else "registry"]
    code = status_of_call(lambda: raw(channel, method)(data, timeout=TIMEOUT))
    check(code, call)
    if method.endswith("Register") and code == grpc.StatusCode.OK:
        # an insider may register anything; take it out again so no request is routed there
        wid = rpb.RegisterRequest.FromString(data).worker_id
        rgrpc.RegistryStub(setup["channels"]["registry"]).Deregister(
            rpb.DeregisterRequest(worker_id=wid), timeout=5)


# ---- workers (with the cluster secret) ----------------------------------------------------

@pytest.fixture(scope="module")
def genuine(setup):
    """A real reservation (the fuzz forges variants of it); its blocks are released after."""
    dec = wgrpc.DecodeWorkerStub(setup["channels"]["decode"])
    reply = dec.Reserve(wire.reserve_to_pb(ReserveInput("fuzz-genuine", tuple(prompt(3, 20)),
                                                        SAMPLING)), timeout=10)
    yield wire.reservation_from_pb(reply)
    dec.Abort(pb.AbortRequest(request_id="fuzz-genuine"), timeout=5)


@st.composite
def destinations(draw, genuine) -> wpb.Destination:
    """The genuine reservation with fields forged (other blocks, slot, lease, endpoint,
    signature bits), or made up from scratch."""
    r = genuine
    forged = {
        "block_ids": st.one_of(fuzz.seeded(_block_ids), st.just(tuple(b + 1 for b in r.block_ids))),
        "slot": maybe(hostile_int(*UINT32)),
        "skip_blocks": hostile_int(*UINT32),
        "lease_seconds": hostile_float(64),
        "transfer_endpoint": st.one_of(hostile_text(), st.just("tcp://127.0.0.1:1")),
        "worker_id": hostile_text(),
        "incarnation": hostile_text(),
        "signature": st.one_of(st.binary(max_size=40),
                               st.integers(0, 31).map(lambda i: _flip(r.signature, i))),
    }
    keys = draw(st.sets(st.sampled_from(sorted(forged)), min_size=1))
    res = replace(r, **{k: draw(forged[k]) for k in keys})
    assume(res != r)  # the genuine one is not a forgery (and its lease ran out long ago)
    return wire.reservation_to_pb(res, wpb.Destination)


def _block_ids(rng) -> list[int]:
    pool = [0, 1, 95, 96, 2**31 - 1, 2**32 - 1]
    return [rng.choice(pool) if rng.random() < 0.5 else rng.randrange(2**32)
            for _ in range(rng.randrange(9))]


def _flip(signature: bytes, i: int) -> bytes:
    out = bytearray(signature or bytes(32))
    out[i % len(out)] ^= 1
    return bytes(out)


@st.composite
def prefill_streams(draw, genuine) -> list[bytes]:
    """0-3 PrefillRequest messages: the first with a prompt, request id, sampling and maybe a
    (forged) destination; later ones the destination alone; any may be mutated bytes."""
    msgs = []
    for i in range(draw(st.integers(0, 3))):
        m = wpb.PrefillRequest()
        if i == 0:
            m.request_id = draw(st.one_of(st.just("fuzz-genuine"), hostile_text()))
            m.prompt_ids.extend(draw(token_ids()))
            m.session_id = draw(hostile_text())
            if draw(st.booleans()):
                m.sampling.CopyFrom(draw(sampling()))
        if i > 0 or draw(st.booleans()):
            m.destination.CopyFrom(draw(destinations(genuine)))
        data = m.SerializeToString()
        msgs.append(draw(mutated(data)) if draw(st.integers(0, 4)) == 0 else data)
    return msgs


@fuzz_settings(CASES)
@given(data=st.data())
def test_prefill_worker_fuzz(setup, genuine, data):
    ch = setup["channels"]["prefill"]
    which = data.draw(st.sampled_from(["Prefill"] * 6 + ["Abort", "Stats"]))
    if which == "Prefill":
        msgs = data.draw(prefill_streams(genuine))
        call = raw(ch, "/baton.v1.PrefillWorker/Prefill", "stream_unary")
        code = status_of_call(lambda: call(iter(msgs), timeout=TIMEOUT))
        check(code, msgs)
        return
    if which == "Abort":
        msg = pb.AbortRequest(request_id=data.draw(hostile_text())).SerializeToString()
    else:
        msg = pb.StatsRequest(pool_checksum=data.draw(st.booleans())).SerializeToString()
    msg = data.draw(st.one_of(st.just(msg), mutated(msg)))
    code = status_of_call(lambda: raw(ch, f"/baton.v1.PrefillWorker/{which}")(msg, timeout=TIMEOUT))
    check(code, (which, msg))


@fuzz_settings(CASES)
@given(data=st.data())
def test_decode_worker_fuzz(setup, genuine, data):
    ch = setup["channels"]["decode"]
    which = data.draw(st.sampled_from(["Reserve"] * 4 + ["Decode"] * 2 + ["Abort", "Stats"]))
    rid = data.draw(hostile_text())
    if which == "Reserve":
        m = wpb.ReserveRequest(request_id=rid, prompt_ids=data.draw(token_ids()),
                               session_id=data.draw(hostile_text()))
        if data.draw(st.booleans()):
            m.sampling.CopyFrom(data.draw(sampling()))
    elif which == "Decode":
        m = wpb.DecodeRequest(request_id=rid, first_token_id=data.draw(hostile_int(*INT32)))
    elif which == "Abort":
        m = pb.AbortRequest(request_id=rid)
    else:
        m = pb.StatsRequest(pool_checksum=data.draw(st.booleans()))
    msg = m.SerializeToString()
    msg = data.draw(st.one_of(st.just(msg), mutated(msg)))
    kind = "unary_stream" if which == "Decode" else "unary_unary"
    call = raw(ch, f"/baton.v1.DecodeWorker/{which}", kind)
    if which == "Decode":
        code = status_of_call(lambda: list(call(msg, timeout=TIMEOUT)))
    else:
        code = status_of_call(lambda: call(msg, timeout=TIMEOUT))
    check(code, (which, msg))
    if which == "Reserve" and code == grpc.StatusCode.OK:
        # free what an accepted reservation holds, as its router would on failure
        sent = wpb.ReserveRequest.FromString(msg).request_id
        wgrpc.DecodeWorkerStub(ch).Abort(pb.AbortRequest(request_id=sent), timeout=5)
