"""Chaos matrix: kill -9 a prefill worker, a decode worker and the router, each during prefill,
during transfer and during decode, with 16 requests in flight (real processes, NIXL).

Worker kills: every request ends with exactly the local engine's tokens and text (a dead
decode worker's streams move to a new pair; a dead prefill worker's requests retry). Router
kill: clients get UNAVAILABLE and the workers free everything within their lease. After each
case the supervisor (`LocalCluster.supervise`, as `baton serve`) has restarted the killed
process and every worker passes `check_integrity` with nothing held.

"During transfer" is made long enough to hit: BATON_TEST_TRANSFER_HOLD_S keeps each transfer
in flight (reported done no sooner) for HOLD_S seconds. One cluster serves every case.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from baton.auth.grpc_auth import authorized
from baton.client.local import run_local
from baton.client.remote import to_pb
from baton.client.requests import RequestSpec
from baton.cluster.local import LocalCluster, free_port
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.proto_gen import baton_pb2, router_pb2_grpc, worker_pb2_grpc
from tests.integration.cluster_helpers import assert_clean, list_workers, write_config
from tests.support.engine_helpers import make_checkpoint, prompt
from transfer.sender import TEST_HOLD_ENV

pytestmark = pytest.mark.integration

LEASE_S = 5.0
HOLD_S = 0.6
N = 16
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
    "router": {"policy": "least_loaded", "eject_after_seconds": 10.0, "heartbeat_seconds": 0.5,
               "max_retries": 3},
    "worker": {"max_num_seqs": 32, "max_model_len": 2048},
    "transfer": {"lease_seconds": LEASE_S},
}
PREFILL, DECODE = baton_pb2.WORKER_ROLE_PREFILL, baton_pb2.WORKER_ROLE_DECODE


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos")
    model = make_checkpoint(root)
    cfg_path = write_config(root / "baton.yaml", CONFIG)
    old = os.environ.get(TEST_HOLD_ENV)
    os.environ[TEST_HOLD_ENV] = str(HOLD_S)  # the children (and their restarts) inherit it
    cluster = LocalCluster(str(model), 2, 2, free_port(), str(cfg_path), log_level="WARNING")
    try:
        # the local engine's tokens for every case, computed while the cluster starts
        engine = build_engine(BatonConfig.from_dict(CONFIG), str(model))
        expected = {}
        for case, (_, phase) in enumerate(CASES):
            for r in run_local(engine, specs_for(case, phase), concurrency=N):
                expected[r["id"]] = (r["token_ids"], r["text"])
        cluster.wait_ready(timeout=240)
    except BaseException:
        cluster.stop()
        _restore(old)
        raise
    cluster.supervise()
    yield {"cluster": cluster, "expected": expected}
    cluster.stop()
    _restore(old)


def _restore(old: str | None) -> None:
    if old is None:
        os.environ.pop(TEST_HOLD_ENV, None)
    else:
        os.environ[TEST_HOLD_ENV] = old


def specs_for(case: int, phase: str) -> list[RequestSpec]:
    """Greedy and seeded requests; longer prompts when the kill is to land in the prefill."""
    # prefill: 480-585 tokens, 8 a prefill worker, more than one step's max_batch_tokens
    # (2,048): with 120-225 a worker's 8 prompts were one step of ~0.2 s and a fresh-clone
    # run's poll once never saw a prompt computing with no answer decoding yet
    base = 480 if phase == "prefill" else 20
    # long enough for a kill to land mid-stream: a killed decode worker's streams must still be
    # running to move, and a killed router must cut at least half of them; 120 tokens of the
    # tiny model on the fast decode path were sometimes all streamed between the poll that saw
    # them decoding and the kill; a decode victim's 400 were once all streamed while a loaded
    # machine's poll asked for it twice (the poll saw no decoding in 30 s), so it streams
    # 1,200: more than the surviving decode worker's pool holds for all 16 at once, so the
    # moved streams also check that its reservations never over-commit it (they ran out of
    # blocks mid-answer when reservations did not count the blocks their answers would take);
    # a killed router's 400 were once 11 of 16 streamed between the poll and the kill on a
    # fresh-clone run, so it streams 1,200 too; a killed prefill worker's decode case streams
    # 400: with 120 (about 0.1 s a stream on the Zen 4) a fresh-clone run's poll once saw no
    # decoding in 30 s
    tokens = {"prefill": 400, "router": 1200, "decode": 1200}
    n_tokens = tokens[CASES[case][0]] if phase == "decode" else 16
    out = []
    for i in range(N):
        sampling = SamplingParams(max_tokens=n_tokens, ignore_eos=True, temperature=0.8 * (i % 2),
                                  top_k=40 * (i % 2), seed=1000 * case + i if i % 2 else None)
        out.append(RequestSpec(f"x{case}-{i}", prompt_ids=prompt(7000 + 100 * case + i,
                                                                   base + 7 * i),
                               sampling=sampling))
    return out


def stream(address: str, spec: RequestSpec) -> dict:
    """One Generate: tokens, text, summary, or the error's status code."""
    got = {"id": spec.id, "token_ids": [], "text": ""}
    with grpc.insecure_channel(address) as ch:
        try:
            for msg in router_pb2_grpc.RouterStub(ch).Generate(to_pb(spec), timeout=120):
                got["token_ids"].extend(msg.token_ids)
                got["text"] += msg.text
                if msg.finish_reason:
                    got.update(retries=msg.retries, prompt_tokens=msg.prompt_tokens,
                               decode_worker=msg.decode_worker)
        except grpc.RpcError as e:
            got["error"] = e.code()
            got["details"] = e.details()
    return got


def stats(address: str, role: int, bearer: str, channel: grpc.Channel | None = None):
    """A worker's counters and load (on `channel` if given, else on a channel of its own)."""
    if channel is None:
        with authorized(grpc.insecure_channel(address), bearer) as ch:
            return stats(address, role, bearer, ch)
    stub = (worker_pb2_grpc.PrefillWorkerStub if role == PREFILL
            else worker_pb2_grpc.DecodeWorkerStub)(channel)
    reply = stub.Stats(baton_pb2.StatsRequest(), timeout=10)
    return dict(reply.counters), reply.load


def pid_of(worker_id: str) -> int:
    """Worker ids are role-host-pid-port."""
    return int(worker_id.rsplit("-", 2)[1])


def wait_for_workers(cluster, role: int | None, timeout: float = 120.0) -> list:
    """Until the router answers with 2 live workers of `role` and at least one of the other
    (None: one of each): a worker killed by an earlier case has been restarted by then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pids = {p.pid for p in cluster.procs if p.poll() is None}
            workers = [w for w in list_workers(cluster.address) if pid_of(w.worker_id) in pids]
            count = {r: sum(w.role == r for w in workers) for r in (PREFILL, DECODE)}
            if all(n >= (2 if role == r else 1) for r, n in count.items()):
                return workers
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the cluster did not get back 2 workers of role {role}")


def pick_victim(workers, victim: str, phase: str, bearer: str, timeout: float = 30.0):
    """Polls the workers until the requests are in `phase`; returns (pid, what was seen).
    One channel a worker for the whole poll (a new one a call made a poll of four workers take
    long enough for a decode worker's streams to end between its answer and the kill); a decode
    victim is asked once more, alone, right before it is chosen, that it is still decoding."""
    chans = {w.worker_id: authorized(grpc.insecure_channel(w.address), bearer) for w in workers}
    try:
        return _poll(workers, victim, phase, bearer, chans, timeout)
    finally:
        for ch in chans.values():
            ch.close()


def _poll(workers, victim: str, phase: str, bearer: str, chans: dict, timeout: float):
    deadline = time.monotonic() + timeout
    by_role = {r: [w for w in workers if w.role == r] for r in (PREFILL, DECODE)}
    while time.monotonic() < deadline:
        seen = {w.worker_id: stats(w.address, w.role, bearer, chans[w.worker_id])
                for w in workers}
        pre = {w: c for w, (c, _) in seen.items() if w.startswith("prefill")}
        dec = {w: (c, load) for w, (c, load) in seen.items() if w.startswith("decode")}
        computing = [w for w, c in pre.items()
                     if c["engine_requests"] > c["transfers_in_flight"]]
        sending = [w for w, c in pre.items() if c["transfers_in_flight"] > 0]
        decoding = [w for w, (c, load) in dec.items() if load.running > 0]
        reserved = [w for w, (c, load) in dec.items() if c["live_requests"] > load.running]
        if phase == "prefill" and computing and reserved and not decoding:
            chosen = computing if victim == "prefill" else reserved
        elif phase == "transfer" and sending and reserved:
            chosen = sending if victim == "prefill" else reserved
        elif phase == "decode" and decoding:
            chosen = decoding if victim == "decode" else [w.worker_id for w in by_role[PREFILL]]
            if victim == "decode":
                w = next(w for w in workers if w.worker_id == chosen[0])
                if stats(w.address, w.role, bearer, chans[w.worker_id])[1].running == 0:
                    continue
        else:
            time.sleep(0.01)
            continue
        return pid_of(chosen[0]), seen
    last = {w: (c, str(load).replace("\n", " ")) for w, (c, load) in seen.items()}
    raise AssertionError(f"the requests were never seen in {phase}; last seen: {last}")


def run_case(setup, case: int, victim: str, phase: str):
    cluster = setup["cluster"]
    bearer = cluster.secret.bearer
    workers = wait_for_workers(cluster, {"prefill": PREFILL, "decode": DECODE}.get(victim))
    specs = specs_for(case, phase)
    expected = setup["expected"]
    results: list[dict] = [None] * N
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, stream(cluster.address, specs[i]))) for i in range(N)]
    for t in threads:
        t.start()
    if victim == "router":
        _, seen = pick_victim(workers, "decode" if phase == "decode" else "prefill", phase,
                              bearer)
        proc = cluster.procs[0]
    else:
        pid, seen = pick_victim(workers, victim, phase, bearer)
        proc = next(p for p in cluster.procs if p.pid == pid)
    killed_at = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return results, expected, killed_at, workers


CASES = [(victim, phase) for phase in ("prefill", "transfer", "decode")
         for victim in ("prefill", "decode", "router")]
"""Interleaved: a killed worker restarts while the next two cases run."""


@pytest.mark.parametrize("victim, phase", CASES, ids=[f"{v}-during-{p}" for v, p in CASES])
def test_kill_9(setup, victim, phase):
    case = CASES.index((victim, phase))
    if victim == "router":
        killed_router(setup, case, phase)
    else:
        killed_worker(setup, case, victim, phase)


def killed_worker(setup, case: int, victim: str, phase: str) -> None:
    """0 failed requests, 0 wrong tokens (and text), every token counted once."""
    results, expected, _, _ = run_case(setup, case, victim, phase)
    failed = [(r["id"], r["error"], r["details"]) for r in results if "error" in r]
    assert failed == []
    wrong = [r["id"] for r in results if (r["token_ids"], r["text"]) != expected[r["id"]]]
    assert wrong == []
    assert all(r["prompt_tokens"] == len(s.prompt_ids)
               for r, s in zip(results, specs_for(case, phase), strict=True))
    if victim == "decode" and phase == "decode":  # its streams moved to the other one
        assert any(r["retries"] > 0 for r in results)
    assert_clean(setup["cluster"])


def killed_router(setup, case: int, phase: str) -> None:
    """Clients get UNAVAILABLE; the workers free everything within their lease."""
    cluster = setup["cluster"]
    results, expected, killed_at, workers = run_case(setup, case, "router", phase)
    for r in results:  # a request that ended before the kill is whole and right
        if "error" in r:
            assert r["error"] == grpc.StatusCode.UNAVAILABLE, r
        else:
            assert (r["token_ids"], r["text"]) == expected[r["id"]]
    assert sum("error" in r for r in results) >= N // 2
    # the router is dead (or restarting): ask the workers themselves
    bearer = cluster.secret.bearer
    while True:
        held = {w.worker_id: stats(w.address, w.role, bearer)[0] for w in workers}
        if all(c["live_requests"] == 0 and c["engine_requests"] == 0 for c in held.values()):
            break
        assert time.monotonic() - killed_at < LEASE_S + 3.0, held
        time.sleep(0.1)
    assert all(c["integrity_ok"] == 1.0 for c in held.values())
    wait_for_workers(cluster, None)  # the supervisor restarted the router; workers are back
    assert_clean(cluster)
