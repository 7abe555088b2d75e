"""Fuzzing a running cluster (router + 1 prefill + 1 decode worker, real processes, with a cluster
secret and an API key) as an authenticated but hostile client would.

Router gRPC, the HTTP API, both worker services (with the cluster secret) and the decode
worker's ZeroMQ side channel (sealed with the secret) each get thousands of cases: protobuf
messages with hostile field values (huge, negative, NaN, unicode, empty, very long, wrong ids,
forged block lists) and raw mutated bytes. Every answer is OK or a client-error status
(tests/support/fuzz.py: never INTERNAL, UNKNOWN or UNAVAILABLE; HTTP never 5xx); no process
dies; afterwards a normal request gives the colocated engine's tokens and nothing is leaked.
Hypothesis draws each case's kind and seed (derandomized: the same cases in every run); the
bulk of a case comes from a seeded generator (tests/support/fuzz.py `Hostile`), so thousands of
cases fit in CI time. A failure prints its kind and seed.
"""

from __future__ import annotations

import collections
import http.client
import json
from dataclasses import replace
from urllib.parse import urlsplit

import grpc
import msgpack
import pytest
import zmq
from hypothesis import example, given

from baton.auth.grpc_auth import authorized
from baton.client.local import run_local
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.contract import GenerateInput, PrefillInput, Reservation, ReserveInput, wire
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import router_pb2_grpc as rgrpc
from baton.proto_gen import worker_pb2 as wpb
from baton.proto_gen import worker_pb2_grpc as wgrpc
from tests.integration.cluster_helpers import assert_clean, start_cluster, write_config
from tests.support.engine_helpers import make_checkpoint, prompt
from tests.support.fuzz import CLIENT_ERRORS, INT32, UINT32, UINT64, Hostile, cases, fuzz_settings
from transfer import SIDE_CHANNEL
from transfer import wire as side

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
"""Cases of the larger tests: the router API gets 2,000 (Generate 1,000, Registry and
ListWorkers 500, HTTP 500), the worker APIs 2,000 (prefill 1,000, decode 1,000) and the side
channel 2,000."""
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
                "registry": authorized(grpc.insecure_channel(cluster.address), bearer),
                "outsider": authorized(grpc.insecure_channel(cluster.address), "wrong-key-1234")}
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


SEEN: collections.Counter = collections.Counter()
"""(api, status) -> cases: the last test checks that each API both accepted and refused."""


def check(code: grpc.StatusCode, what, api: str) -> None:
    SEEN[api, code.name] += 1
    assert code == grpc.StatusCode.OK or code in CLIENT_ERRORS, (code, what)


def raw(channel: grpc.Channel, method: str, kind: str = "unary_unary"):
    """`method` taking and returning raw bytes (what a hostile client can send)."""
    return getattr(channel, kind)(method, request_serializer=None, response_deserializer=None)


# ---- hostile protobuf messages -------------------------------------------------------------

def sampling(h: Hostile) -> pb.SamplingParams:
    m = pb.SamplingParams(ignore_eos=h.chance())
    if h.chance():
        m.max_tokens = h.int(*UINT32)
    if h.chance():
        m.temperature = h.float()
    if h.chance():
        m.top_p = h.float()
    if h.chance():
        m.top_k = h.int(*UINT32)
    if h.chance():
        m.seed = h.int(*UINT64)
    if h.chance(0.3):
        m.stop_token_ids.extend(h.int(*INT32) for _ in range(h.rng.randrange(4)))
    return m


def ids(h: Hostile) -> list[int]:
    return h.ids(VOCAB, MAX_MODEL_LEN)


def generate_request(kind: str, h: Hostile) -> tuple[str, bytes]:
    """(channel, message): mostly with the API key, some from an outsider with a wrong one."""
    m = rpb.GenerateRequest(request_id=h.text(), session_id=h.text())
    if kind == "ids":
        m.prompt_ids.extend(ids(h))
    else:
        m.prompt = h.text(60)
    if h.chance(0.8):
        m.sampling.CopyFrom(sampling(h))
    data = m.SerializeToString()
    return ("outsider" if kind == "outsider" else "router",
            h.mutate(data) if kind == "mutated" else data)


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
@given(case=cases(generate_request, ("ids",) * 3 + ("text",) * 2 + ("mutated",) * 2 +
                 ("outsider",)))
@example(case=("router", rpb.GenerateRequest(prompt_ids=[5, 6], sampling=pb.SamplingParams(
    temperature=float("nan"))).SerializeToString()))
def test_router_generate_fuzz(setup, case):
    channel, data = case
    generate = raw(setup["channels"][channel], "/baton.v1.Router/Generate", "unary_stream")
    code = status_of_call(lambda: consume_first(generate(data, timeout=TIMEOUT)))
    check(code, data[:200], "Generate")
    if channel == "outsider":
        assert code == grpc.StatusCode.UNAUTHENTICATED


def load(h: Hostile) -> pb.WorkerLoad:
    return pb.WorkerLoad(**{k: h.int(*UINT32) for k in (
        "running", "waiting", "free_blocks", "free_slots", "total_blocks", "total_slots")})


def registry_call(kind: str, h: Hostile) -> tuple[str, bytes]:
    """Register / Heartbeat / Deregister / ListWorkers with hostile values; worker ids are
    never the live workers' (an insider may re-register those)."""
    wid = "fuzz-" + h.text()
    if kind == "Register":
        m = rpb.RegisterRequest(worker_id=wid, role=h.int(*INT32), address=h.text(),
                                load=load(h), tokens_per_block=h.int(*UINT32),
                                max_model_len=h.int(*UINT32))
    elif kind == "Heartbeat":
        events = [pb.SnapshotEvent(kind=h.int(*INT32), block_hash=h.int(*UINT64),
                                   snapshot_hash=h.int(*UINT64), num_tokens=h.int(*UINT32))
                  for _ in range(h.rng.randrange(4))]
        m = rpb.HeartbeatRequest(worker_id=wid, load=load(h), snapshot_events=events)
    elif kind == "Deregister":
        m = rpb.DeregisterRequest(worker_id=wid)
    else:
        m = rpb.ListWorkersRequest(role=h.int(*INT32))
    data = m.SerializeToString()
    service = "Router" if kind == "ListWorkers" else "Registry"
    return f"/baton.v1.{service}/{kind}", h.mutate(data) if h.chance(0.25) else data


@fuzz_settings(CASES // 2)
@given(call=cases(registry_call, ("Register", "Heartbeat", "Deregister", "ListWorkers")))
@example(call=("/baton.v1.Router/ListWorkers", rpb.ListWorkersRequest(role=7).SerializeToString()))
@example(call=("/baton.v1.Registry/Register", rpb.RegisterRequest(
    worker_id="fuzz-x", role=pb.WORKER_ROLE_DECODE, address="",
    tokens_per_block=0).SerializeToString()))
def test_router_registry_and_list_fuzz(setup, call):
    method, data = call
    channel = setup["channels"]["router" if "Router" in method else "registry"]
    code = status_of_call(lambda: raw(channel, method)(data, timeout=TIMEOUT))
    check(code, call, method.rpartition("/")[2])
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
    GENUINE.append(wire.reservation_from_pb(reply))
    yield GENUINE[0]
    dec.Abort(pb.AbortRequest(request_id="fuzz-genuine"), timeout=5)
    GENUINE.clear()


GENUINE: list[Reservation] = []
"""The module's genuine reservation, for the case builders (strategies are made at import)."""


def forged(h: Hostile, r: Reservation) -> wpb.Destination:
    """`r` with fields forged (other blocks, slot, lease, endpoint, signature bits), or made up
    from scratch; never `r` itself (its lease ran out long ago: not a forgery)."""
    forgeries = {
        "block_ids": lambda: tuple(b + 1 for b in r.block_ids) if h.chance() else tuple(
            h.int(*UINT32) for _ in range(h.rng.randrange(9))),
        "slot": lambda: None if h.chance(0.3) else h.int(*UINT32),
        "skip_blocks": lambda: h.int(*UINT32),
        "lease_seconds": h.float,
        "transfer_endpoint": lambda: "tcp://127.0.0.1:1" if h.chance() else h.text(),
        "worker_id": h.text,
        "incarnation": h.text,
        "signature": lambda: h.rng.randbytes(h.rng.randrange(41)) if h.chance() else
        _flip(r.signature, h.rng.randrange(32)),
    }
    res = r
    while res == r:
        keys = h.rng.sample(sorted(forgeries), h.rng.randint(1, 4))
        res = replace(r, **{k: forgeries[k]() for k in keys})
    return wire.reservation_to_pb(res, wpb.Destination)


def _flip(signature: bytes, i: int) -> bytes:
    out = bytearray(signature or bytes(32))
    out[i % len(out)] ^= 1
    return bytes(out)


def prefill_call(kind: str, h: Hostile) -> tuple[str, list[bytes]]:
    """Prefill: 0-3 messages, the first with a prompt, request id, sampling and maybe a (forged)
    destination, later ones the destination alone, any of them maybe mutated bytes.
    Abort / Stats: one message."""
    if kind == "Abort":
        msgs = [pb.AbortRequest(request_id=h.text()).SerializeToString()]
    elif kind == "Stats":
        msgs = [pb.StatsRequest(pool_checksum=h.chance()).SerializeToString()]
    else:
        msgs = []
        for i in range(h.rng.randrange(4)):
            m = wpb.PrefillRequest()
            if i == 0:
                m.request_id = "fuzz-genuine" if h.chance(0.3) else h.text()
                m.prompt_ids.extend(ids(h))
                m.session_id = h.text()
                if h.chance():
                    m.sampling.CopyFrom(sampling(h))
            if i > 0 or h.chance():
                m.destination.CopyFrom(forged(h, GENUINE[0]))
            msgs.append(m.SerializeToString())
    return kind, [h.mutate(m) if h.chance(0.2) else m for m in msgs]


@fuzz_settings(CASES)
@given(call=cases(prefill_call, ("Prefill",) * 6 + ("Abort", "Stats")))
def test_prefill_worker_fuzz(setup, genuine, call):
    kind, msgs = call
    ch = setup["channels"]["prefill"]
    if kind == "Prefill":
        prefill = raw(ch, "/baton.v1.PrefillWorker/Prefill", "stream_unary")
        code = status_of_call(lambda: prefill(iter(msgs), timeout=TIMEOUT))
    else:
        code = status_of_call(lambda: raw(ch, f"/baton.v1.PrefillWorker/{kind}")(
            msgs[0], timeout=TIMEOUT))
    check(code, call, f"PrefillWorker.{kind}")


def decode_call(kind: str, h: Hostile) -> tuple[str, bytes]:
    rid = h.text()
    if kind == "Reserve":
        m = wpb.ReserveRequest(request_id=rid, prompt_ids=ids(h), session_id=h.text())
        if h.chance():
            m.sampling.CopyFrom(sampling(h))
    elif kind == "Decode":
        m = wpb.DecodeRequest(request_id=rid, first_token_id=h.int(*INT32))
    elif kind == "Abort":
        m = pb.AbortRequest(request_id=rid)
    else:
        m = pb.StatsRequest(pool_checksum=h.chance())
    data = m.SerializeToString()
    return kind, h.mutate(data) if h.chance(0.25) else data


@fuzz_settings(CASES)
@given(call=cases(decode_call, ("Reserve",) * 4 + ("Decode",) * 2 + ("Abort", "Stats")))
@example(call=("Decode", wpb.DecodeRequest(request_id="never-reserved").SerializeToString()))
def test_decode_worker_fuzz(setup, genuine, call):
    kind, msg = call
    ch = setup["channels"]["decode"]
    method = raw(ch, f"/baton.v1.DecodeWorker/{kind}",
                 "unary_stream" if kind == "Decode" else "unary_unary")
    if kind == "Decode":
        code = status_of_call(lambda: list(method(msg, timeout=TIMEOUT)))
    else:
        code = status_of_call(lambda: method(msg, timeout=TIMEOUT))
    check(code, call, f"DecodeWorker.{kind}")
    if kind == "Reserve" and code == grpc.StatusCode.OK:
        # free what an accepted reservation holds, as its router would on failure
        sent = wpb.ReserveRequest.FromString(msg).request_id
        wgrpc.DecodeWorkerStub(ch).Abort(pb.AbortRequest(request_id=sent), timeout=5)


def test_a_huge_request_id_gets_its_own_status(setup, genuine):
    """Regression (found by the fuzz): an error message quoting a 70 kB request id overflowed
    the client's metadata limit, so the caller saw RESOURCE_EXHAUSTED instead of the status."""
    for rid in (" " * 70_000, "\U0001f600" * 3000):
        with pytest.raises(grpc.RpcError) as e:
            list(wgrpc.DecodeWorkerStub(setup["channels"]["decode"]).Decode(
                wpb.DecodeRequest(request_id=rid), timeout=TIMEOUT))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "more characters" in e.value.details()
        msg = wpb.PrefillRequest(request_id=rid, prompt_ids=[5, 6, 7],
                                 destination=forged(Hostile(1), genuine))
        with pytest.raises(grpc.RpcError) as e:
            wgrpc.PrefillWorkerStub(setup["channels"]["prefill"]).Prefill(iter([msg]),
                                                                           timeout=TIMEOUT)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("first", [-1, VOCAB, 2**31 - 1, -2**31])
def test_decode_from_a_first_token_outside_the_vocabulary_is_refused(setup, first):
    """An insider's Decode after a genuine Reserve + Prefill, with a first token the model has
    no embedding for: refused, and the worker decodes the next request exactly."""
    dec = wgrpc.DecodeWorkerStub(setup["channels"]["decode"])
    pre = wgrpc.PrefillWorkerStub(setup["channels"]["prefill"])
    ids = prompt(30, 10)
    rid = f"first-{first}"
    res = wire.reservation_from_pb(dec.Reserve(
        wire.reserve_to_pb(ReserveInput(rid, tuple(ids), SAMPLING)), timeout=TIMEOUT))
    pre.Prefill(iter([wire.prefill_to_pb(PrefillInput(rid, tuple(ids), SAMPLING, "", res))]),
                timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as e:
        list(dec.Decode(wpb.DecodeRequest(request_id=rid, first_token_id=first),
                        timeout=TIMEOUT))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    alive(setup)


@pytest.mark.parametrize("length", [5, 36])
def test_prefill_of_another_length_than_reserved_is_refused(setup, length):
    """A genuine reservation for a 20-token prompt, used for a prompt of another length: the
    blocks do not fit it; refused without a write, and nothing is held afterwards."""
    dec = wgrpc.DecodeWorkerStub(setup["channels"]["decode"])
    pre = wgrpc.PrefillWorkerStub(setup["channels"]["prefill"])
    rid = f"len-{length}"
    res = wire.reservation_from_pb(dec.Reserve(
        wire.reserve_to_pb(ReserveInput(rid, tuple(prompt(31, 20)), SAMPLING)), timeout=TIMEOUT))
    other = tuple(prompt(32, length))
    with pytest.raises(grpc.RpcError) as e:
        pre.Prefill(iter([wire.prefill_to_pb(PrefillInput(rid, other, SAMPLING, "", res))]),
                    timeout=TIMEOUT)
    assert e.value.code() in CLIENT_ERRORS, (e.value.code(), e.value.details())
    dec.Abort(pb.AbortRequest(request_id=rid), timeout=TIMEOUT)
    alive(setup)


# ---- the OpenAI-compatible HTTP API -------------------------------------------------------

VALID_BODY = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2,
                         "temperature": 0}).encode()
BODY_FIELDS = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
               "seed", "stop", "stream", "n", "session_id", "ignore_eos", "stop_token_ids",
               "logprobs", "stream_options", "return_token_ids", "user", "logit_bias")


def http_request(kind: str, h: Hostile) -> tuple[str, dict, bytes]:
    path = "/v1/completions" if h.chance() else "/v1/chat/completions"
    if kind == "json":  # any JSON at all
        body = json.dumps(h.json(3)).encode()
    elif kind == "bytes":
        body = h.mutate(VALID_BODY)
    else:  # the right shape, a few hostile values (or none: deep enough to generate)
        data = {"model": "tiny", "max_tokens": h.rng.randrange(1, 6), "temperature": 0}
        if path == "/v1/completions":
            data["prompt"] = h.text(20) if h.chance() else [h.rng.randrange(3, VOCAB) for _ in
                                                            range(h.rng.randrange(1, 20))]
        else:
            data["messages"] = [{"role": "user", "content": h.text(20)}]
        for key in h.rng.sample(BODY_FIELDS, h.rng.randrange(3)):
            data[key] = h.json(1)
        if h.chance(0.2):
            data["max_tokens"] = h.int(-2**40, 2**40)
        for key in ("temperature", "top_p", "top_k", "seed"):
            if h.chance(0.15):
                data[key] = h.float() if h.chance(0.5) else h.int(-2**70, 2**70)
        if h.chance(0.2):
            data["prompt" if path == "/v1/completions" else "messages"] = h.json(2) \
                if h.chance() else ids(h)
        body = json.dumps(data).encode()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if h.chance(0.9):
        headers["Content-Type"] = "application/json" if h.chance(0.9) else h.rng.choice(
            ["text/plain", "", "application/x-www-form-urlencoded", "multipart/form-data; "
             "boundary=x", "application/json; charset=utf-16", "\x7f\xff"])
    return path, headers, body


@pytest.fixture(scope="module")
def http_conn(setup):
    url = urlsplit(setup["cluster"].http_address)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT)
    yield conn
    conn.close()


@fuzz_settings(CASES // 2)
@given(req=cases(http_request, ("json", "bytes", "shaped", "shaped")))
@example(req=("/v1/completions", {"Authorization": f"Bearer {API_KEY}"},
              b'{"model": "tiny", "prompt": [5], "temperature": 1e-300}'))
def test_http_api_fuzz(setup, http_conn, req):
    path, headers, body = req
    for attempt in (0, 1):
        try:
            http_conn.request("POST", path, body=body, headers=headers)
            resp = http_conn.getresponse()
            resp.read()
            break
        except (http.client.HTTPException, OSError):  # it may close the connection after a 4xx
            http_conn.close()
            if attempt:
                raise
    SEEN["http", resp.status // 100 * 100] += 1
    assert resp.status < 500, (resp.status, path, body[:300])
    if resp.will_close:
        http_conn.close()


# ---- the ZeroMQ side channel (sealed with the cluster secret) -----------------------------

SENTINEL_OP = "fuzz-sentinel"
SIDE_FIELDS = ("fingerprint", "backend", "rid", "error", "layout", "slot", "blocks", "layers",
               "v", "op", "seq", "transport", "incarnation")


def side_frames(kind: str, h: Hostile) -> tuple[list[bytes], bool]:
    """(frames, sealed with the right key): hostile messages of every op, mutated and random
    bytes, unsealed or wrongly sealed frames, extra frames."""
    op = h.rng.choice(sorted(side.SCHEMAS)) if h.chance(0.8) else h.json(1, binary=True)
    fields = {k: h.json(2, binary=True) for k in h.rng.sample(SIDE_FIELDS, h.rng.randrange(5))}
    msg = msgpack.packb({"v": 1, "op": op, **fields}, use_bin_type=True)
    if kind == "mutated":
        msg = h.mutate(msg)
    elif kind == "bytes":
        msg = h.rng.randbytes(h.rng.randrange(80))
    sealed = kind != "unsealed"
    key = KEY[0] if sealed else h.rng.choice([None, bytes(32)])
    frames = [side.seal(msg, key)]
    if kind == "frames":
        frames.append(h.rng.randbytes(h.rng.randrange(8)))
        sealed = False  # two frames are dropped before the MAC is read
    return frames, sealed


KEY: list[bytes] = []
"""The cluster's side-channel key (set by the `side_socket` fixture)."""


@pytest.fixture(scope="module")
def side_socket(setup, genuine):
    KEY.append(setup["cluster"].secret.key(SIDE_CHANNEL))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(genuine.transfer_endpoint)
    yield sock
    sock.close()
    KEY.clear()


@fuzz_settings(2 * CASES)
@given(case=cases(side_frames, ("message", "message", "mutated", "bytes", "unsealed", "frames")))
def test_side_channel_fuzz(setup, side_socket, case):
    frames, sealed = case
    key = KEY[0]
    side_socket.send_multipart(frames)
    # a sealed unknown op is always refused: its reply marks the end of the fuzz frame's
    side_socket.send(side.seal(side.encode(SENTINEL_OP), key))
    replies = []
    while True:
        assert side_socket.poll(int(TIMEOUT * 1000)), "the side channel stopped answering"
        reply = side.decode(side.unseal(side_socket.recv(), key), 1 << 20)
        if SENTINEL_OP in reply.get("error", ""):
            break
        replies.append(reply)
    assert len(replies) <= 1 and (sealed or not replies), (frames, replies)
    SEEN["side", replies[0]["op"] if replies else "no reply"] += 1
    for reply in replies:  # a refusal names what is wrong; nothing crashed inside
        assert reply["op"] in ("refused", "welcome"), reply
        assert "internal error" not in reply.get("error", ""), (frames, reply)


def test_side_channel_refuses_an_op_of_another_type(setup, side_socket):
    """Regression (found by the fuzz): an op that is not a string was an internal error."""
    key = KEY[0]
    for op in ([], {"a": 1}, b"hello", 7):
        side_socket.send(side.seal(msgpack.packb({"v": 1, "op": op}, use_bin_type=True), key))
        assert side_socket.poll(int(TIMEOUT * 1000))
        reply = side.decode(side.unseal(side_socket.recv(), key), 1 << 20)
        assert reply["op"] == "refused" and "unexpected message op" in reply["error"], reply


# ---- after all of it ----------------------------------------------------------------------

def test_after_the_fuzz_the_cluster_serves_exact_tokens(setup):
    alive(setup)
    if SEEN:  # the fuzz ran in this session: it reached past the door and was refused too
        ok = {api for api, code in SEEN if code in ("OK", 200)}
        refused = {api for api, code in SEEN if code in {c.name for c in CLIENT_ERRORS} | {400}}
        assert {"Generate", "http", "DecodeWorker.Reserve"} <= ok & refused, SEEN
        assert {"PrefillWorker.Prefill", "DecodeWorker.Decode"} <= refused, SEEN
        assert SEEN["side", "refused"] and SEEN["side", "no reply"], SEEN
    ids = prompt(11, 24)
    req = wire.generate_to_pb(GenerateInput("after-fuzz", tuple(ids), None, SAMPLING))
    msgs = list(rgrpc.RouterStub(setup["channels"]["router"]).Generate(req, timeout=60))
    engine = build_engine(BatonConfig.from_dict(CONFIG), str(setup["model"]))
    (ref,) = run_local(engine, [RequestSpec("ref", prompt_ids=ids, sampling=SAMPLING)])
    assert [t for m in msgs for t in m.token_ids] == ref["token_ids"]
    assert_clean(setup["cluster"])
