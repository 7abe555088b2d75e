"""An authenticated cluster (router + 1 prefill + 1 decode, real processes) against an outsider.

Every internal RPC and side-channel message without the cluster secret is refused and changes
nothing (worker Stats, pool bytes and the registry before == after); a forged or altered
reservation moves no byte; a live worker id cannot be taken over; Generate needs an API key.
The same small cluster (one decode worker running 4 requests) shows overload queueing.
"""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
import zmq

from baton.auth import ClusterSecret
from baton.auth.grpc_auth import authorized
from baton.client.local import run_local
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.contract import (
    GenerateInput,
    PrefillInput,
    Reservation,
    ReserveInput,
    Role,
    ServeInput,
    SnapshotShipment,
    WorkerInfo,
    wire,
)
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import router_pb2_grpc as rgrpc
from baton.proto_gen import worker_pb2 as wpb
from baton.proto_gen import worker_pb2_grpc as wgrpc
from tests.integration.cluster_helpers import start_cluster, write_config
from tests.support.engine_helpers import make_checkpoint, prompt
from transfer import wire as side

pytestmark = pytest.mark.integration

API_KEY = "public-api-key-for-the-test"
CONFIG = {
    "cache": {"num_blocks": 128, "num_state_slots": 24},
    "worker": {"max_num_seqs": 4, "max_model_len": 512},
    "router": {"heartbeat_seconds": 0.5, "eject_after_seconds": 30.0},
    "transfer": {"lease_seconds": 30.0},
}
SAMPLING = SamplingParams(max_tokens=6, ignore_eos=True)
UNAUTH = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    model = make_checkpoint(root)
    (root / "keys").write_text(API_KEY + "\n")
    cfg = {**CONFIG, "router": {**CONFIG["router"], "api_keys_file": str(root / "keys")}}
    cluster = start_cluster(model, write_config(root / "baton.yaml", cfg), prefill=1, decode=1)
    try:
        bearer = cluster.secret.bearer
        with authorized(grpc.insecure_channel(cluster.address), bearer) as ch:
            listed = rgrpc.RouterStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=5)
        addr = {w.role: w.address for w in listed.workers}
        yield {"cluster": cluster, "bearer": bearer, "model": model,
               "prefill": addr[pb.WORKER_ROLE_PREFILL], "decode": addr[pb.WORKER_ROLE_DECODE],
               "ids": {w.role: w.worker_id for w in listed.workers},
               "config": BatonConfig.from_dict(CONFIG)}
    finally:
        cluster.stop()


def channel(address: str, bearer: str | None = None) -> grpc.Channel:
    return authorized(grpc.insecure_channel(address), bearer)


def local_tokens(setup, prompt_ids) -> list[int]:
    engine = build_engine(setup["config"], str(setup["model"]))
    (res,) = run_local(engine, [RequestSpec("ref", prompt_ids=prompt_ids, sampling=SAMPLING)])
    return res["token_ids"]


def stats(setup) -> dict:
    """Both workers' Stats (counters with the pools' CRC, load) and the router's registry."""
    out = {}
    for role, stub_cls in (("prefill", wgrpc.PrefillWorkerStub), ("decode", wgrpc.DecodeWorkerStub)):
        with channel(setup[role], setup["bearer"]) as ch:
            reply = stub_cls(ch).Stats(pb.StatsRequest(pool_checksum=True), timeout=10)
        out[role] = (dict(reply.counters), reply.load)
    with channel(setup["cluster"].address, setup["bearer"]) as ch:
        listed = rgrpc.RouterStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=5).workers
    out["registry"] = sorted((w.worker_id, w.role, w.address) for w in listed)
    return out


def reserve(setup, rid: str, prompt_ids) -> Reservation:
    with channel(setup["decode"], setup["bearer"]) as ch:
        reply = wgrpc.DecodeWorkerStub(ch).Reserve(
            wire.reserve_to_pb(ReserveInput(rid, tuple(prompt_ids), SAMPLING)), timeout=10)
    return wire.reservation_from_pb(reply)


def prefill(setup, rid: str, prompt_ids, dest: Reservation, bearer: str | None = "default"):
    bearer = setup["bearer"] if bearer == "default" else bearer
    msg = wire.prefill_to_pb(PrefillInput(rid, tuple(prompt_ids), SAMPLING, "", dest))
    with channel(setup["prefill"], bearer) as ch:
        return wgrpc.PrefillWorkerStub(ch).Prefill(iter([msg]), timeout=60)


def decode(setup, rid: str, first: int) -> list[int]:
    with channel(setup["decode"], setup["bearer"]) as ch:
        call = wgrpc.DecodeWorkerStub(ch).Decode(
            wpb.DecodeRequest(request_id=rid, first_token_id=first), timeout=60)
        return [first] + [t for m in call for t in m.token_ids]


def refused(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code()


def outsider_calls(setup, bearer: str | None) -> dict[str, object]:
    """Every internal RPC, as an outsider would make it (`bearer`: none or a wrong one)."""
    victim = Reservation(setup["ids"][pb.WORKER_ROLE_DECODE], "tcp://127.0.0.1:1", (0, 1, 2), 0)
    d, p = channel(setup["decode"], bearer), channel(setup["prefill"], bearer)
    r = channel(setup["cluster"].address, bearer)
    dec, pre, reg = wgrpc.DecodeWorkerStub(d), wgrpc.PrefillWorkerStub(p), rgrpc.RegistryStub(r)
    info = WorkerInfo(setup["ids"][pb.WORKER_ROLE_DECODE], Role.DECODE, "127.0.0.1:9")
    return {
        "DecodeWorker.Reserve": lambda: dec.Reserve(
            wire.reserve_to_pb(ReserveInput("evil", (5, 6, 7), SAMPLING)), timeout=5),
        "DecodeWorker.Decode": lambda: list(dec.Decode(
            wpb.DecodeRequest(request_id="evil", first_token_id=3), timeout=5)),
        "DecodeWorker.Abort": lambda: dec.Abort(pb.AbortRequest(request_id="evil"), timeout=5),
        "DecodeWorker.Stats": lambda: dec.Stats(pb.StatsRequest(pool_checksum=True), timeout=5),
        "DecodeWorker.Serve": lambda: list(dec.Serve(wire.serve_to_pb(
            ServeInput("evil", (5, 6, 7), SAMPLING, "", 512)), timeout=5)),
        "DecodeWorker.HoldSnapshot": lambda: dec.HoldSnapshot(
            wire.reserve_to_pb(ReserveInput("evil", (5, 6, 7), SAMPLING)), timeout=5),
        "PrefillWorker.Prefill": lambda: pre.Prefill(iter([wire.prefill_to_pb(
            PrefillInput("evil", (5, 6, 7), SAMPLING, "", victim))]), timeout=5),
        "PrefillWorker.Abort": lambda: pre.Abort(pb.AbortRequest(request_id="evil"), timeout=5),
        "PrefillWorker.Stats": lambda: pre.Stats(pb.StatsRequest(), timeout=5),
        "PrefillWorker.PullSnapshot": lambda: pre.PullSnapshot(wire.shipment_to_pb(
            SnapshotShipment("evil", (5, 6, 7), victim)), timeout=5),
        "Registry.Register": lambda: reg.Register(wire.register_to_pb(info), timeout=5),
        "Registry.Heartbeat": lambda: reg.Heartbeat(rpb.HeartbeatRequest(
            worker_id=info.worker_id, load=pb.WorkerLoad(running=99)), timeout=5),
        "Registry.Deregister": lambda: reg.Deregister(
            rpb.DeregisterRequest(worker_id=info.worker_id), timeout=5),
        "_channels": (d, p, r),
    }


@pytest.mark.parametrize("who", ["no credentials", "another secret", "the raw token"])
def test_every_internal_rpc_without_the_secret_is_refused_and_changes_nothing(setup, who):
    bearer = {"no credentials": None,
              "another secret": ClusterSecret("another-cluster-secret").bearer,
              "the raw token": setup["cluster"].token}[who]  # only the derived bearer counts
    before = stats(setup)
    calls = outsider_calls(setup, bearer)
    channels = calls.pop("_channels")
    try:
        codes = {name: refused(fn) for name, fn in calls.items()}
    finally:
        for ch in channels:
            ch.close()
    assert codes == {name: UNAUTH for name in calls}
    assert stats(setup) == before


def test_the_outsider_list_covers_every_internal_rpc(setup):
    """A new worker or registry method must join `outsider_calls` (and so be shown refused)."""
    services = [wpb.DESCRIPTOR.services_by_name["DecodeWorker"],
                wpb.DESCRIPTOR.services_by_name["PrefillWorker"],
                rpb.DESCRIPTOR.services_by_name["Registry"]]
    every = {f"{s.name}.{m.name}" for s in services for m in s.methods}
    calls = outsider_calls(setup, None)
    for ch in calls.pop("_channels"):
        ch.close()
    assert set(calls) == every


def test_registry_takeover_is_refused_even_with_the_secret(setup):
    before = stats(setup)
    wid = setup["ids"][pb.WORKER_ROLE_DECODE]
    with channel(setup["cluster"].address, setup["bearer"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            rgrpc.RegistryStub(ch).Register(wire.register_to_pb(
                WorkerInfo(wid, Role.DECODE, "127.0.0.1:9")), timeout=5)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"worker id {wid!r} is registered and live at another address" in e.value.details()
    assert stats(setup) == before


def test_forged_and_altered_reservations_move_no_byte(setup):
    ids = prompt(7, 40)
    res = reserve(setup, "cap-1", ids)
    assert len(res.signature) == 32 and res.incarnation
    before = stats(setup)
    forged = {
        "other blocks": replace(res, block_ids=tuple(b + 1 for b in res.block_ids)),
        "other slot": replace(res, slot=(res.slot or 0) + 1),
        "longer lease": replace(res, lease_seconds=3600.0),
        "no signature": replace(res, signature=b""),
        "made up": Reservation(res.worker_id, res.transfer_endpoint, (0, 1, 2), 0,
                               incarnation=res.incarnation, signature=bytes(32)),
    }
    for what, dest in forged.items():
        with pytest.raises(grpc.RpcError) as e:
            prefill(setup, "cap-1", ids, dest)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
    with pytest.raises(grpc.RpcError) as e:  # a real reservation, used for another request
        prefill(setup, "cap-2", ids, res)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "does not match its signature" in e.value.details()
    assert stats(setup) == before  # pools (CRC), counters, loads and registry unchanged
    # the genuine reservation is intact and gives the colocated engine's tokens
    first = prefill(setup, "cap-1", ids, res).first_token_id
    assert decode(setup, "cap-1", first) == local_tokens(setup, ids)


def test_side_channel_without_the_secret_is_dropped_and_changes_nothing(setup):
    ids = prompt(8, 30)
    res = reserve(setup, "sc-1", ids)
    before = stats(setup)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(res.transfer_endpoint)
    wrong = ClusterSecret("another-cluster-secret").key("transfer-side-channel")
    try:
        for msg in (side.encode("hello", fingerprint={"dtype": "float16"}, backend="nixl"),
                    side.encode("abort", rid="sc-1", error="outsider"),
                    side.encode("posted", rid="sc-1"),
                    side.seal(side.encode("abort", rid="sc-1", error="outsider"), wrong),
                    side.seal(side.encode("hello", fingerprint={}, backend="nixl"), wrong)):
            sock.send(msg)
        assert not sock.poll(500)  # no welcome (base addresses), no refusal (local values)
    finally:
        sock.close()
    assert stats(setup) == before
    first = prefill(setup, "sc-1", ids, res).first_token_id  # the abort did not land
    assert decode(setup, "sc-1", first) == local_tokens(setup, ids)


def test_generate_needs_an_api_key(setup):
    ids = prompt(9, 12)
    req = wire.generate_to_pb(GenerateInput("k1", tuple(ids), None, SAMPLING))
    for bearer in (None, "wrong-api-key-123", setup["cluster"].token):
        with channel(setup["cluster"].address, bearer) as ch:
            stub = rgrpc.RouterStub(ch)
            assert refused(lambda s=stub: list(s.Generate(req, timeout=30))) == UNAUTH
            assert refused(lambda s=stub: s.ListWorkers(rpb.ListWorkersRequest())) == UNAUTH
    with channel(setup["cluster"].address, API_KEY) as ch:
        msgs = list(rgrpc.RouterStub(ch).Generate(req, timeout=60))
    assert [t for m in msgs for t in m.token_ids] == local_tokens(setup, ids)
    assert {m.request_id for m in msgs} == {"k1"}


def test_overload_waits_in_the_router_queue_instead_of_failing(setup):
    """16 requests at once on a decode worker that runs 4: every one answered, exactly."""
    from concurrent.futures import ThreadPoolExecutor

    specs = {f"o{i}": prompt(400 + i, 5 + 3 * i) for i in range(16)}
    engine = build_engine(setup["config"], str(setup["model"]))
    expected = {r["id"]: r["token_ids"] for r in run_local(
        engine, [RequestSpec(k, prompt_ids=v, sampling=SAMPLING) for k, v in specs.items()])}

    def one(item):
        rid, ids = item
        with channel(setup["cluster"].address, API_KEY) as ch:
            msgs = list(rgrpc.RouterStub(ch).Generate(
                wire.generate_to_pb(GenerateInput(rid, tuple(ids), None, SAMPLING)), timeout=120))
        return rid, [t for m in msgs for t in m.token_ids]

    with ThreadPoolExecutor(16) as pool:
        got = dict(pool.map(one, specs.items()))
    assert got == expected
