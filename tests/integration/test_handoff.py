"""The prefill -> decode handoff through real processes: layer-wise streaming and the overlap of
Prefill with Reserve."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from baton.client.local import run_local
from baton.client.remote import run_remote, to_pb
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.config.router import RouterConfig
from baton.contract import Role
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.proto_gen import router_pb2_grpc
from bench.harness.fake_workers import Act, FakeWorker, Script
from router.server import run_router
from tests.integration.cluster_helpers import (
    assert_clean,
    list_workers,
    start_cluster,
    worker_counters,
    write_config,
)
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = pytest.mark.integration

LAYERWISE = {
    "cache": {"num_blocks": 512, "num_state_slots": 32,
              "mamba_state_config": {"periodic_snapshot_interval": 64}},
    "worker": {"max_num_seqs": 8, "prefill_chunk_size": 64, "max_batch_tokens": 256,
               "max_model_len": 2048},
    "transfer": {"layerwise": True, "lease_seconds": 60.0},
}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def by_role(address: str, role: Role, bearer: str | None = None) -> dict[str, float]:
    (info,) = [w for w in list_workers(address)
               if w.role == (1 if role is Role.PREFILL else 2)]
    return worker_counters(info, bearer)


@pytest.mark.parametrize("kv_dtype", ["model", "float8_e4m3"])
def test_layerwise_streaming_gives_local_tokens_and_no_lease_expiry(tmp_path, kv_dtype):
    """Also with fp8 KV (issue 50): the rows and their scales move as the block's bytes, so
    1P+1D still equals --local."""
    model = make_checkpoint(tmp_path)
    cfg = {**LAYERWISE, "cache": {**LAYERWISE["cache"], "kv_dtype": kv_dtype}}
    cluster = start_cluster(model, write_config(tmp_path / "lw.yaml", cfg), 1, 1)
    try:
        lengths = (1, 15, 16, 17, 64, 65, 200, 333, 700)
        specs = [RequestSpec(f"lw{i}", prompt_ids=prompt(40 + i, n), sampling=greedy(12))
                 for i, n in enumerate(lengths)]
        t0 = time.monotonic()
        remote = run_remote(cluster.address, specs, concurrency=3)
        took = time.monotonic() - t0
        engine = build_engine(BatonConfig.from_dict(cfg), str(model))
        expected = run_local(engine, specs)
        assert [r.get("token_ids", r.get("error")) for r in remote] == \
            [r["token_ids"] for r in expected]
        prefill = by_role(cluster.address, Role.PREFILL, cluster.secret.bearer)
        # every request went through a handoff, long prompts layer by layer during their last
        # chunk's forward; none waited for a lease (60 s) to end it
        assert prefill["handoffs"] == len(specs) == prefill["transfers_done"]
        assert prefill["streamed_handoffs"] >= 1
        assert took < LAYERWISE["transfer"]["lease_seconds"] / 2
        # the decode-end snapshots shipped back in the background (router/shipping.py) hold
        # a live slot on the decode worker while the prefill worker reads them
        deadline = time.monotonic() + 15
        while True:
            decode = by_role(cluster.address, Role.DECODE, cluster.secret.bearer)
            prefill = by_role(cluster.address, Role.PREFILL, cluster.secret.bearer)
            if (decode["live_requests"] == 0 and prefill["live_requests"] == 0) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert decode["integrity_ok"] == 1.0 and prefill["integrity_ok"] == 1.0
        assert decode["live_requests"] == 0 and prefill["live_requests"] == 0
        stored = "float8_e4m3fn" if kv_dtype == "float8_e4m3" else "float32"
        spec = engine.pools.spec  # both workers store and count the configured format
        for c in (prefill, decode):
            assert c[f"kv_format.{stored}"] == 1.0
            assert c["kv_block_bytes"] == spec.kv_bytes_per_block()
            assert c.get("canary_bad_blocks", 0) == 0
    finally:
        cluster.stop()


def test_prefill_computes_before_reserve_returns(tmp_path):
    """A decode worker whose Reserve blocks: the real prefill worker still computes the prompt
    (its own counters show it) while that Reserve has not returned."""
    model = make_checkpoint(tmp_path)
    handle = run_router(0, RouterConfig(eject_after_seconds=600.0))  # the fake never beats
    decode = FakeWorker(Role.DECODE, "d0", Script(reserve=Act.HANG, hang_limit_s=30.0))
    decode.register(handle.address)
    env = {k: v for k, v in os.environ.items() if k != "BATON_CLUSTER_TOKEN"}  # no secret here
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "--log-level", "WARNING",
                             "prefill-worker", "--router", handle.address, "--model", str(model)],
                            env=env)
    try:
        deadline = time.monotonic() + 180
        while len(handle.registry.workers(Role.PREFILL)) < 1:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        ids = prompt(7, 300)
        spec = RequestSpec("ov1", prompt_ids=ids, sampling=greedy(4))
        with grpc.insecure_channel(handle.address) as ch:
            call = router_pb2_grpc.RouterStub(ch).Generate(to_pb(spec), timeout=60)
            computed = 0.0
            while computed < len(ids):
                assert time.monotonic() < deadline
                computed = by_role(handle.address, Role.PREFILL)["queried_tokens"]
            # the whole prompt went through the prefill worker's cache while Reserve hangs
            # (the router names the request by an id of its own on the workers)
            [(method, wid)] = decode.calls()
            assert method == "Reserve"
            call.cancel()
        assert _wait(lambda: ("Abort", wid) in decode.calls())
        assert _wait(lambda: by_role(handle.address, Role.PREFILL)["live_requests"] == 0)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        decode.stop()
        handle.stop()


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


STATE16 = {
    "cache": {"num_blocks": 512, "num_state_slots": 24, "state_dtype": "bfloat16",
              "state_rounding": "stochastic", "state_rounding_seed": 3,
              "mamba_state_config": {"periodic_snapshot_interval": 64,
                                     "additional_snapshot_offsets_from_end": [0]}},
    "worker": {"max_num_seqs": 8, "prefill_chunk_size": 64, "max_batch_tokens": 256,
               "max_model_len": 2048},
    "transfer": {"lease_seconds": 60.0},
    "router": {"local_prefill_max_tokens": 0},
}
"""bf16 + stochastic state, the prompt end a rounding point (offset 0 from the end): the
handoff moves the state in 16 bits, staged in a snapshot slot on both sides. Every turn goes
through the prefill worker, which pulls the decode-end snapshots back (in 16 bits too)."""


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_16bit_state_handoff_equals_local_at_half_the_state_bytes(tmp_path, layerwise):
    """1P+1D equals --local bit for bit (tokens and every logprob) with bf16 stochastic
    state, and each handoff wrote exactly half the float32 state bytes: the rounded
    prompt-end state went from a bf16 snapshot slot to a bf16 snapshot slot and widened into
    the decode worker's float32 live slot on landing. Canaries armed: nothing stray landed."""
    from baton.cache import canary

    model = make_checkpoint(tmp_path)
    cfg = {**STATE16, "transfer": {**STATE16["transfer"], "layerwise": layerwise}}
    env = pytest.MonkeyPatch()
    env.setenv(canary.ENV, "1")
    try:
        cluster = start_cluster(model, write_config(tmp_path / "s16.yaml", cfg), 1, 1)
    finally:
        env.undo()
    try:
        lengths = (1, 17, 64, 65, 200, 333)
        specs = [RequestSpec(f"s{i}", prompt_ids=prompt(60 + i, n),
                             sampling=SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1))
                 for i, n in enumerate(lengths)]
        remote = run_remote(cluster.address, specs, concurrency=3)
        engine = build_engine(BatonConfig.from_dict(cfg), str(model))
        expected = run_local(engine, specs)

        def logprobs(results):
            return [[float(np.float32(x["logprob"] if isinstance(x, dict) else x.logprob))
                     for x in r["logprobs"]] for r in results]

        assert [r.get("token_ids", r.get("error")) for r in remote] == \
            [r["token_ids"] for r in expected]
        assert logprobs(remote) == logprobs(expected)
        spec = engine.pools.spec
        assert spec.snapshot_slots > 0 and spec.num_slots == 9  # live rows: 8 + the pad row
        f32, b16 = spec.state_bytes_per_slot(), spec.snapshot_bytes_per_slot()
        assert 2 * b16 == f32
        counters = assert_clean(cluster)
        (prefill,) = [c for wid, c in counters.items() if wid.startswith("prefill")]
        assert prefill["handoffs"] == len(specs)
        assert prefill["handoff_state_bytes_total"] == len(specs) * b16
        assert prefill["last_handoff_state_bytes"] == b16 == f32 // 2
        if layerwise:
            assert prefill["streamed_handoffs"] >= 1
        for c in counters.values():
            assert c["canary_slots_checked"] > 0, c
        _second_turns_restore_16bit_pulls(cluster, engine, specs, remote, logprobs, b16)
    finally:
        cluster.stop()


def _second_turns_restore_16bit_pulls(cluster, engine, specs, remote, logprobs, b16):
    """The decode-end snapshots shipped back to the prefill worker (router/shipping.py) moved
    in 16 bits (half the float32 state bytes each: the decode worker narrows the held state
    into a staging snapshot slot, the prefill worker reads it into one and widens it on
    adopting), and a second turn restoring one gives --local's tokens and logprobs, bit for
    bit (--local restores its own decode-end snapshot there)."""
    def prefill():
        return by_role(cluster.address, Role.PREFILL, cluster.secret.bearer)

    deadline, last = time.monotonic() + 30, -1.0
    while time.monotonic() < deadline:  # shipments run in the background after each turn
        now = prefill()["snapshots_pulled"]
        if now == len(specs) or (now == last and now > 0):
            break
        last = now
        time.sleep(1.0)
    c = prefill()
    assert c["snapshots_pulled"] >= 1 and c["snapshots_adopted"] >= 1, c
    assert c["pulled_state_bytes_total"] == c["snapshots_pulled"] * b16, c
    turn2 = [RequestSpec(f"{s.id}b", prompt_ids=s.prompt_ids + r["token_ids"] + prompt(90 + i, 9),
                         sampling=s.sampling)
             for i, (s, r) in enumerate(zip(specs, remote, strict=True))]
    got = run_remote(cluster.address, turn2, concurrency=1)
    restored = [i for i, (s, r) in enumerate(zip(specs, got, strict=True))
                if r.get("cached_tokens", 0) >= len(s.prompt_ids) + 7]  # a decode-end hit
    assert restored, [r.get("cached_tokens") for r in got]
    for i in restored:  # --local: the turn again (its decode-end snapshot fresh), then turn 2
        want = run_local(engine, [specs[i], turn2[i]])[1]
        assert want["cached_tokens"] == got[i]["cached_tokens"], turn2[i].id
        assert got[i]["token_ids"] == want["token_ids"], turn2[i].id
        assert logprobs([got[i]]) == logprobs([want]), turn2[i].id
    assert_clean(cluster)
