"""The disaggregated cluster (router, 2 prefill, 2 decode; NIXL over UCX) against --local.

One cluster for the module; the worker-kill test runs last because it changes the cluster.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from baton.client.local import run_local
from baton.client.remote import run_remote, to_pb
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.proto_gen import baton_pb2, router_pb2, router_pb2_grpc
from tests.integration.cluster_helpers import (
    assert_clean,
    list_workers,
    start_cluster,
    write_config,
)
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = pytest.mark.integration

CONFIG = {
    "cache": {
        "num_blocks": 1024,
        "num_state_slots": 96,
        "mamba_state_config": {
            "periodic_snapshot_interval": 32,
            "additional_snapshot_offsets_from_end": [0],
            "decode_end_snapshot": True,
        },
    },
    "router": {"policy": "session", "eject_after_seconds": 10.0, "heartbeat_seconds": 0.5},
    "worker": {"max_num_seqs": 32, "max_model_len": 2048},
    "transfer": {"lease_seconds": 120.0},
}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cluster-model"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, model):
    root = tmp_path_factory.mktemp("cluster")
    cfg_path = write_config(root / "baton.yaml", CONFIG)
    cluster = start_cluster(model, cfg_path, prefill=2, decode=2)
    yield {"cluster": cluster, "model": model, "config": BatonConfig.from_dict(CONFIG)}
    cluster.stop()


SR = {"state_dtype": "bfloat16", "state_rounding": "stochastic", "state_rounding_seed": 7}
"""bf16 state with stochastic rounding (docs/state-precision.md): snapshots stored in 16 bits,
the prefill workers round the prompt end before its bytes leave; P/D still equals --local."""


@pytest.fixture(scope="module", params=["float32", "bf16-stochastic"])
def state_setup(request, model, tmp_path_factory):
    """The module's cluster (float32 state), or one whose state is bf16 + stochastic."""
    if request.param == "float32":
        yield request.getfixturevalue("setup")
        return
    root = tmp_path_factory.mktemp("cluster-sr")
    cfg = {**CONFIG, "cache": {**CONFIG["cache"], **SR}}
    cluster = start_cluster(model, write_config(root / "baton.yaml", cfg), 2, 2)
    yield {"cluster": cluster, "model": model, "config": BatonConfig.from_dict(cfg)}
    cluster.stop()


def local(setup, specs, concurrency=1):
    return run_local(build_engine(setup["config"], str(setup["model"])), specs, concurrency)


def tokens(results):
    return {r["id"]: r.get("token_ids", r.get("error")) for r in results}


def test_32_concurrent_requests_equal_local(state_setup):
    setup = state_setup
    specs = [
        RequestSpec(f"c{i}", prompt_ids=prompt(i, 1 + 13 * i), sampling=greedy(10))
        for i in range(32)
    ]
    remote = run_remote(setup["cluster"].address, specs, concurrency=32)
    assert tokens(remote) == tokens(local(setup, specs))
    used = {(r["prefill_worker"], r["decode_worker"]) for r in remote}
    assert len({p for p, _ in used}) == 2 and len({d for _, d in used}) == 2
    assert_clean(setup["cluster"])


def test_six_turn_chat_reuses_prefix_with_session_routing(state_setup):
    setup = state_setup
    history: list[int] = []
    remote_cached, remote_toks, specs = [], [], []
    for turn in range(6):
        ids = history + prompt(500 + turn, 20)
        spec = RequestSpec(f"t{turn}", prompt_ids=ids, session="chat-1", sampling=greedy(8))
        (res,) = run_remote(setup["cluster"].address, [spec])
        specs.append(spec)
        remote_cached.append(res["cached_tokens"])
        remote_toks.append(res["token_ids"])
        history = ids + res["token_ids"]
    assert remote_toks == [r["token_ids"] for r in local(setup, specs)]
    assert remote_cached[0] == 0 and all(c > 0 for c in remote_cached[1:]), remote_cached
    assert_clean(setup["cluster"])


def test_prefix_cache_hits_give_local_tokens(state_setup):
    setup = state_setup
    base = prompt(900, 96)
    specs = [
        RequestSpec(f"p{i}", prompt_ids=base + prompt(901 + i, 5 + i), session="shared",
                    sampling=greedy(6))
        for i in range(4)
    ]
    remote = run_remote(setup["cluster"].address, specs)
    assert tokens(remote) == tokens(local(setup, specs))
    # periodic snapshots at 32, 64, 96 of the first prompt: the others reuse exactly 96
    assert [r["cached_tokens"] for r in remote] == [0, 96, 96, 96]


def test_handed_off_state_gives_local_logprobs(state_setup):
    """Cold prompts go through a prefill worker: every token's logprob (float32 on the wire)
    equals --local's, so the state handed off is the state --local had, bit for bit (with
    bf16 state: rounded at the prompt end before its bytes left)."""
    setup = state_setup
    specs = [RequestSpec(f"lp{i}", prompt_ids=prompt(700 + i, 40 + 23 * i),
                         sampling=SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1))
             for i in range(4)]
    remote = run_remote(setup["cluster"].address, specs)
    assert all(r["prefill_worker"] for r in remote)

    def logprobs(results):
        return {r["id"]: [float(np.float32(x["logprob"] if isinstance(x, dict) else x.logprob))
                          for x in r["logprobs"]] for r in results}

    assert logprobs(remote) == logprobs(local(setup, specs))
    assert_clean(setup["cluster"])


@pytest.mark.parametrize(
    "req, msg",
    [
        (router_pb2.GenerateRequest(prompt_ids=[], sampling=baton_pb2.SamplingParams(max_tokens=4)), "empty"),
        (router_pb2.GenerateRequest(prompt_ids=[5] * 3000), "max model length"),
        (router_pb2.GenerateRequest(prompt_ids=[5] * 10, sampling=baton_pb2.SamplingParams(max_tokens=2**32 - 1)), "lower max_tokens to at most 2038"),
        (router_pb2.GenerateRequest(prompt_ids=[5, 10**6]), "vocabulary"),
        (router_pb2.GenerateRequest(prompt_ids=[5], sampling=baton_pb2.SamplingParams(temperature=-1)), "temperature"),
        (router_pb2.GenerateRequest(prompt_ids=[5], sampling=baton_pb2.SamplingParams(top_p=2.0)), "top_p"),
        (router_pb2.GenerateRequest(prompt_ids=[5], sampling=baton_pb2.SamplingParams(max_tokens=0)), "max_tokens"),
    ],
)
def test_bad_requests_get_invalid_argument(setup, req, msg):
    with grpc.insecure_channel(setup["cluster"].address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert msg in err.value.details()
    assert len(list_workers(setup["cluster"].address)) == 4


def test_cancel_mid_stream_frees_both_workers(setup):
    spec = RequestSpec("cancel-me", prompt_ids=prompt(77, 40), sampling=greedy(1500))
    with grpc.insecure_channel(setup["cluster"].address) as ch:
        stream = router_pb2_grpc.RouterStub(ch).Generate(to_pb(spec), timeout=120)
        got = 0
        for msg in stream:
            got += len(msg.token_ids)
            if got >= 5:
                break
        stream.cancel()
    assert got >= 5
    assert_clean(setup["cluster"])


def test_unknown_fields_get_invalid_argument(setup):
    raw = router_pb2.GenerateRequest(prompt_ids=[5, 6]).SerializeToString() + bytes([0xA8, 0x06, 0x01])
    with grpc.insecure_channel(setup["cluster"].address) as ch:
        call = ch.unary_stream(
            "/baton.v1.Router/Generate", request_serializer=lambda b: b,
            response_deserializer=router_pb2.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(call(raw, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown field number(s) [101]" in err.value.details()


def test_killing_a_prefill_worker_in_flight(setup):
    """Runs last: ejects one prefill worker; its requests retry elsewhere with correct tokens."""
    cluster = setup["cluster"]
    specs = [RequestSpec(f"k{i}", prompt_ids=prompt(300 + i, 200 + 10 * i), sampling=greedy(6))
             for i in range(16)]
    expected = tokens(local(setup, specs))
    victim = next(p for p in cluster.procs if "prefill-worker" in p.args)
    results = {}
    runner = threading.Thread(
        target=lambda: results.update(r=run_remote(cluster.address, specs, concurrency=16))
    )
    runner.start()
    time.sleep(0.3)
    victim.kill()
    runner.join(timeout=180)
    assert not runner.is_alive(), "a request hung after a prefill worker died"
    assert tokens(results["r"]) == expected
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        roles = [w.role for w in list_workers(cluster.address)]
        if roles.count(baton_pb2.WORKER_ROLE_PREFILL) == 1:
            break
        time.sleep(0.3)
    assert roles.count(baton_pb2.WORKER_ROLE_PREFILL) == 1
    assert_clean(cluster)


def test_a_handoff_reports_its_phases_and_equal_tokens(setup):
    """A prompt longer than router.local_prefill_max_tokens goes through a prefill worker;
    its `--json` result names where the time to first token went (baton/worker/phases.py)."""
    specs = [RequestSpec(f"ph{i}", prompt_ids=prompt(90 + i, 700 + 37 * i),
                         sampling=greedy(4)) for i in range(2)]
    remote = run_remote(setup["cluster"].address, specs)
    assert tokens(remote) == tokens(local(setup, specs))
    for r in remote:
        assert r["prefill_worker"], r
        ph = r["phases_ms"]
        for name in ("p_forward", "p_sample", "p_total", "r_reserve", "r_prefill", "r_rpc",
                     "r_open", "r_reply", "r_ttft"):
            assert ph[name] >= 0.0, (name, ph)
        # the parts sit inside their wholes (the worker's time inside the router's call)
        assert ph["p_forward"] <= ph["p_total"] <= ph["r_prefill"] <= ph["r_ttft"]
        # one host: the call's gRPC time splits into its two ways; instants are not phases
        assert ph["r_open"] + ph["r_reply"] <= ph["r_rpc"] + 0.01
        assert not [k for k in ph if k.startswith("at_")], ph
    assert_clean(setup["cluster"])
