"""The generated stubs match proto/, import from one folder, and the wire conversions round-trip."""

from __future__ import annotations

from pathlib import Path

from baton.proto_gen import baton_pb2, gen, router_pb2, worker_pb2
from baton.sampling import SamplingParams
from router import wire
from router.types import PrefillInput, Reservation

STUBS = Path(gen.__file__).parent


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
    assert set(decode.methods_by_name) == {"Reserve", "Decode", "Abort", "Stats"}
    assert decode.methods_by_name["Decode"].server_streaming
    prefill = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"]
    assert set(prefill.methods_by_name) == {"Prefill", "Abort", "Stats"}
    assert baton_pb2.DESCRIPTOR.package == "baton.v1"


def test_unset_sampling_fields_take_documented_defaults():
    s = wire.sampling_from_pb(baton_pb2.SamplingParams())
    assert s == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, seed=None)
    greedy = wire.sampling_from_pb(baton_pb2.SamplingParams(temperature=0.0))
    assert greedy.temperature == 0.0


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
