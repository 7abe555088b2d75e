"""The generated stubs match proto/, import from one folder, and the wire conversions round-trip."""

from __future__ import annotations

import re
from pathlib import Path

from baton.config.cache import CacheConfig
from baton.config.transfer import TransferConfig
from baton.contract import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_TOKENS_PER_BLOCK,
    DecodeChunk,
    FinishReason,
    GenerateChunk,
    GenerateInput,
    GenerateSummary,
    PrefillInput,
    PrefillResult,
    Reservation,
    ReserveInput,
    Role,
    SnapshotEvent,
    StageInfo,
    WorkerInfo,
    WorkerLoad,
    WorkerView,
    wire,
)
from baton.proto_gen import baton_pb2, gen, router_pb2, worker_pb2
from baton.sampling import SamplingParams

STUBS = Path(gen.__file__).parent
PROTO = gen.PROTO_DIR


def test_stubs_are_up_to_date_with_proto(tmp_path):
    written = gen.generate(tmp_path)
    fresh = {p.name: p.read_text() for p in written}
    stored = {p.name: p.read_text() for p in STUBS.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(stored), "stub set differs: run python -m baton.proto_gen.gen"
    stale = [name for name in fresh if fresh[name] != stored[name]]
    assert not stale, f"stale stubs {stale}: run python -m baton.proto_gen.gen"


def test_public_services_and_streaming_shape():
    router = router_pb2.DESCRIPTOR.services_by_name["Router"]
    assert router.full_name == "baton.v1.Router"
    gen_m = router.methods_by_name["Generate"]
    assert (gen_m.server_streaming, gen_m.client_streaming) == (True, False)
    assert "ListWorkers" in router.methods_by_name
    registry = router_pb2.DESCRIPTOR.services_by_name["Registry"]
    assert set(registry.methods_by_name) == {"Register", "Heartbeat", "Deregister"}
    decode = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"]
    assert set(decode.methods_by_name) == {"Reserve", "Decode", "Serve", "HoldSnapshot", "Abort",
                                           "Stats"}
    assert decode.methods_by_name["Decode"].server_streaming
    assert decode.methods_by_name["Serve"].server_streaming
    prefill = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"]
    assert set(prefill.methods_by_name) == {"Prefill", "PullSnapshot", "Abort", "Stats"}
    assert baton_pb2.DESCRIPTOR.package == "baton.v1"


def test_unset_sampling_fields_take_documented_defaults():
    # one definition: unset protobuf fields take the dataclass's defaults (temperature 0 =
    # greedy), and proto/ documents the same values
    s = wire.sampling_from_pb(baton_pb2.SamplingParams())
    assert s == SamplingParams()
    assert s == SamplingParams(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=None)
    sampled = wire.sampling_from_pb(baton_pb2.SamplingParams(temperature=1.0))
    assert sampled.temperature == 1.0
    documented = _documented_defaults(PROTO / "baton.proto", "SamplingParams")
    assert documented == {"max_tokens": "16", "temperature": "0.0", "top_p": "1.0",
                          "top_k": "0", "seed": "unset"}
    d = SamplingParams()
    assert (d.max_tokens, d.temperature, d.top_p, d.top_k, d.seed) == (16, 0.0, 1.0, 0, None)


def test_zero_lease_and_block_size_take_the_contract_defaults():
    assert wire.reservation_from_pb(worker_pb2.ReserveReply()).lease_seconds == \
        DEFAULT_LEASE_SECONDS == TransferConfig().lease_seconds == 30.0
    assert wire.register_from_pb(router_pb2.RegisterRequest(role=1)).tokens_per_block == \
        DEFAULT_TOKENS_PER_BLOCK == CacheConfig().tokens_per_block == 16
    assert "(default 0 = 30.0)" in (PROTO / "worker.proto").read_text()
    assert "(default 0 = 16)" in (PROTO / "router.proto").read_text()


def _documented_defaults(path: Path, message: str) -> dict[str, str]:
    """Field -> the `(default X` its comment in proto/ gives."""
    body = path.read_text().split(f"message {message} {{", 1)[1].split("\n}", 1)[0]
    out, comment = {}, ""
    for line in body.splitlines():
        line = line.strip()
        if line.startswith("//"):
            comment += line
        elif "=" in line:
            m = re.search(r"\(default ([^ ,)]+)", comment)
            if m:
                out[line.split("=")[0].split()[-1]] = m.group(1)
            comment = ""
    return out


def test_sampling_round_trips_including_unset_optionals():
    for s in (
        SamplingParams(),
        SamplingParams(7, 0.0, 0.5, 40, 1234, (2, 9), True),
    ):
        assert wire.sampling_from_pb(wire.sampling_to_pb(s)) == s


def test_prefill_request_carries_the_reservation():
    res = Reservation("d1", "tcp://h:5", (4, 5, 6), None, skip_blocks=2, lease_seconds=30.0)
    inp = PrefillInput("r1", (1, 2, 3), SamplingParams(max_tokens=3), "s", res)
    m = wire.prefill_to_pb(inp)
    assert not m.destination.HasField("slot")
    back = wire.prefill_from_pb(worker_pb2.PrefillRequest.FromString(m.SerializeToString()))
    assert back == inp
    with_slot = Reservation("d1", "tcp://h:5", (1,), 0)
    assert wire.reservation_from_pb(wire.reservation_to_pb(with_slot)).slot == 0


SAMPLED = SamplingParams(7, 0.75, 0.5, 40, 1234, (2, 9), True)  # float32-exact
RES = Reservation("d1", "tcp://h:5", (4, 5, 6), 3, skip_blocks=1, lease_seconds=12.5,
                  incarnation="9f3a", signature=bytes(range(32)))
SUMMARY = GenerateSummary(FinishReason.STOP, 40, 32, "p1", "d1", 12.5, 80.25, 1)
LOAD = WorkerLoad(1, 2, 3, 4, 5, 6)

ROUND_TRIPS = [
    # (value, to_pb, from_pb, protobuf class on the wire)
    (GenerateInput("g1", (1, 2), None, SAMPLED, "s1"), wire.generate_to_pb,
     wire.generate_from_pb, router_pb2.GenerateRequest),
    (GenerateInput("g2", None, "hello", SamplingParams(), ""), wire.generate_to_pb,
     wire.generate_from_pb, router_pb2.GenerateRequest),
    (GenerateChunk("g1", (5, 6), "ab"), wire.chunk_to_pb, wire.chunk_from_pb,
     router_pb2.GenerateResponse),
    (GenerateChunk("g1", (7,), "c", SUMMARY), wire.chunk_to_pb, wire.chunk_from_pb,
     router_pb2.GenerateResponse),
    (ReserveInput("r1", (1, 2, 3), SAMPLED, "s"), wire.reserve_to_pb, wire.reserve_from_pb,
     worker_pb2.ReserveRequest),
    (RES, wire.reservation_to_pb, wire.reservation_from_pb, worker_pb2.ReserveReply),
    (RES, lambda r: wire.reservation_to_pb(r, worker_pb2.Destination),
     wire.reservation_from_pb, worker_pb2.Destination),
    (Reservation("d2", "tcp://h:6", (), None), wire.reservation_to_pb,
     wire.reservation_from_pb, worker_pb2.ReserveReply),
    (PrefillInput("r1", (1, 2), SAMPLED, "s", RES), wire.prefill_to_pb, wire.prefill_from_pb,
     worker_pb2.PrefillRequest),
    (PrefillResult(9, 16), wire.prefill_result_to_pb, wire.prefill_result_from_pb,
     worker_pb2.PrefillReply),
    (PrefillResult(9, 0, True, FinishReason.STOP), wire.prefill_result_to_pb,
     wire.prefill_result_from_pb, worker_pb2.PrefillReply),
    *[(DecodeChunk((1, 2), reason), wire.decode_chunk_to_pb, wire.decode_chunk_from_pb,
       worker_pb2.DecodeResponse) for reason in (None, *FinishReason)],
    (LOAD, wire.load_to_pb, wire.load_from_pb, baton_pb2.WorkerLoad),
    (SnapshotEvent(True, 2**64 - 1, 7, 33), wire.event_to_pb, wire.event_from_pb,
     baton_pb2.SnapshotEvent),
    (SnapshotEvent(False, 1, 2**63, 16), wire.event_to_pb, wire.event_from_pb,
     baton_pb2.SnapshotEvent),
    *[(WorkerInfo(f"w-{role.value}", role, "h:1", 32, LOAD, 4096), wire.register_to_pb,
       wire.register_from_pb, router_pb2.RegisterRequest) for role in Role],
    (WorkerInfo("d-pp", Role.DECODE, "h:1", 16, LOAD, 4096,
                (StageInfo(0, 5, "tcp://h:7001"), StageInfo(5, 3, "tcp://h:7002"))),
     wire.register_to_pb, wire.register_from_pb, router_pb2.RegisterRequest),
    (WorkerView("d1", Role.DECODE, "h:2", 16, LOAD, 3, 0.5, 9, 2048), wire.worker_view_to_pb,
     wire.worker_view_from_pb, router_pb2.WorkerInfo),
]


def test_every_contract_type_round_trips_through_protobuf_bytes():
    covered = set()
    for value, to_pb, from_pb, cls in ROUND_TRIPS:
        data = to_pb(value).SerializeToString()
        assert from_pb(cls.FromString(data)) == value, value
        covered.add(type(value))
    assert covered == {GenerateInput, GenerateChunk, ReserveInput, Reservation, PrefillInput,
                       PrefillResult, DecodeChunk, WorkerLoad, SnapshotEvent, WorkerInfo,
                       WorkerView}
    assert {DecodeChunk((1, 2), r).finish_reason for r in FinishReason} == set(FinishReason)


def test_each_finish_reason_has_its_own_wire_value():
    values = [wire.finish_to_pb(r) for r in FinishReason]
    assert len(set(values)) == len(FinishReason) and baton_pb2.FINISH_REASON_UNSPECIFIED \
        not in values
    assert wire.finish_to_pb("stop") == baton_pb2.FINISH_REASON_STOP
