"""Pipeline-parallel workers through the router, NIXL handoff across unequal stage splits.

One cluster for the module: prefill workers with PP 1, 2 and 3 and decode workers with PP 1
and 2, on pattern `MMM*-M*-` (prefill PP 3 splits it [3, 3, 2]: stage 0 attention-free,
stage 2 Mamba-free; decode PP 2 splits it [5, 3]). Round-robin routing gives request number
t the pair (t mod 3, t mod 2), so every six consecutive requests cover all six pairs. The
stage-kill tests run last, in file order, because each takes a worker away: the prefill one
leaves prefill PP 1 and 2 with both decode workers, the decode one then leaves decode PP 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from baton.cache import canary
from baton.client.local import run_local
from baton.client.remote import run_remote
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.request import Request, SamplingParams
from baton.proto_gen import baton_pb2
from tests.integration.cluster_helpers import (
    alive,
    assert_clean,
    children,
    list_workers,
    start_cluster,
    worker_counters,
    write_config,
)
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = pytest.mark.integration

PATTERN = "MMM*-M*-"
BASE = {
    "cache": {"num_blocks": 512, "num_state_slots": 64},
    "router": {"policy": "round_robin", "eject_after_seconds": 3.0, "heartbeat_seconds": 0.5,
               # the P+D path on every turn (conditional disaggregation has its own tests)
               "local_prefill_max_tokens": 0, "ship_decode_end_state": False},
    "worker": {"max_num_seqs": 16, "max_model_len": 1024, "prefill_chunk_size": 64},
    "transfer": {"lease_seconds": 60.0},
}
ROLES = {"prefill": {"pipeline_parallel_size": 3, "pp_layer_partition": [3, 3, 2]},
         "decode": {"pipeline_parallel_size": 2, "pp_layer_partition": [5, 3]}}
EXTRA = [("prefill-worker", 1), ("prefill-worker", 2), ("decode-worker", 1)]
"""Workers beside `baton serve`'s (prefill PP 3, decode PP 2): (role, PP) on the base config."""


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _spawn(cluster, role: str, pp: int, model: Path, config: Path, extra_env: dict) -> None:
    env = {**os.environ, "BATON_CLUSTER_TOKEN": cluster.token, "BATON_NUM_THREADS": "1",
           **extra_env}
    cmd = [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", role, "--router",
           cluster.address, "--model", str(model), "--config", str(config),
           "--pipeline-parallel-size", str(pp)]
    cluster.procs.append(subprocess.Popen(cmd, start_new_session=True, env=env, stdout=2))
    cluster.expected += 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppcluster")
    model = make_checkpoint(root, pattern=PATTERN)
    base = write_config(root / "base.yaml", BASE)
    env = pytest.MonkeyPatch()
    env.setenv(canary.ENV, "1")  # every worker and stage: free blocks and slots hold canaries
    try:
        cluster = start_cluster(model, write_config(root / "pp.yaml", {**BASE, **ROLES}), 1, 1)
    finally:
        env.undo()
    try:
        for role, pp in EXTRA:
            _spawn(cluster, role, pp, model, base, {canary.ENV: "1"})
        cluster.wait_ready(timeout=240)
        # worker id -> PP, from the pid in the id (`role-host-pid-port`)
        pp_of = {cluster.procs[1].pid: 3, cluster.procs[2].pid: 2}
        pp_of.update({p.pid: pp for p, (_, pp) in zip(cluster.procs[3:], EXTRA, strict=True)})
        yield {"cluster": cluster, "model": model, "pp_of": pp_of,
               "config": BatonConfig.from_dict(BASE)}
    finally:
        cluster.stop()


def pp_of(setup, worker_id: str) -> int:
    return setup["pp_of"][int(worker_id.split("-")[-2])]


def local(setup, specs, concurrency=4):
    return run_local(build_engine(setup["config"], str(setup["model"])), specs, concurrency)


def tokens(results):
    return {r["id"]: r.get("token_ids", r.get("error")) for r in results}


def test_every_prefill_decode_pp_pair_equals_local(setup):
    specs = [RequestSpec(f"m{i}", prompt_ids=prompt(i, 3 + 17 * i), sampling=greedy(8))
             for i in range(24)]
    remote = run_remote(setup["cluster"].address, specs, concurrency=16)
    assert tokens(remote) == tokens(local(setup, specs))
    pairs = {(pp_of(setup, r["prefill_worker"]), pp_of(setup, r["decode_worker"])) for r in remote}
    assert pairs == {(p, d) for p in (1, 2, 3) for d in (1, 2)}
    counters = assert_clean(setup["cluster"])
    # canaries: every block and slot free now (all of them, on every stage of every worker)
    # still holds the canary written when it was freed: no transfer wrote outside its
    # reservation, on the decode side or anywhere else
    for wid, c in counters.items():
        assert c["canary_bad_blocks"] == 0 and c["canary_bad_slots"] == 0, (wid, c)
        assert c["canary_blocks_checked"] == c["blocks_free"] > 0, (wid, c)
        assert c["canary_slots_checked"] > 0, (wid, c)


def test_constrained_output_with_pp_on_both_sides_equals_local(setup):
    """A grammar through pipeline-parallel prefill and decode workers: the first token drawn
    under it by the prefill worker's last stage, the rest by the decode worker's, which replays
    the first into its own matcher; every token equals --local."""
    from baton.agents import grammar as g

    grammar = g.compile_text('start: "[" NUM ("," NUM){0,7} "]"\nNUM: /[0-9]{1,3}/',
                             "structured_outputs.grammar")
    specs = [RequestSpec(f"g{i}", prompt_ids=prompt(500 + i, 3 + 23 * i),
                         sampling=SamplingParams(max_tokens=40, grammar=grammar))
             for i in range(8)]
    remote = run_remote(setup["cluster"].address, specs, concurrency=8)
    assert tokens(remote) == tokens(local(setup, specs))
    assert all(r["finish_reason"] in ("stop", "length") for r in remote)


def test_six_turn_chat_with_pp_on_both_sides_equals_local(setup):
    address = setup["cluster"].address
    probe = [RequestSpec(f"probe{i}", prompt_ids=[5], sampling=greedy(1)) for i in range(6)]
    slots = [run_remote(address, [s])[0] for s in probe]
    # the round-robin slot (request number mod 6) that lands on prefill PP 3 + decode PP 2
    target = next(i for i, r in enumerate(slots)
                  if (pp_of(setup, r["prefill_worker"]), pp_of(setup, r["decode_worker"])) == (3, 2))
    sent, history, specs, results = 0, [], [], []
    for turn in range(6):
        for i in range((target - sent) % 6):  # fillers: the turn's slot must be `target`
            run_remote(address, [RequestSpec(f"f{turn}-{i}", prompt_ids=[6], sampling=greedy(1))])
            sent += 1
        ids = history + prompt(700 + turn, 20 + turn)  # > 1 block: fillers share no page
        spec = RequestSpec(f"t{turn}", prompt_ids=ids, session="chat", sampling=greedy(6))
        (res,) = run_remote(address, [spec])
        sent += 1
        assert (pp_of(setup, res["prefill_worker"]), pp_of(setup, res["decode_worker"])) == (3, 2)
        specs.append(spec)
        results.append(res)
        history = ids + res["token_ids"]
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in local(setup, specs, 1)]
    cached = [r["cached_tokens"] for r in results]
    assert cached == prefill_side_hits(setup, specs) and all(c > 0 for c in cached[2:]), cached
    assert_clean(setup["cluster"])


def prefill_side_hits(setup, specs) -> list[int]:
    """What one colocated engine that prefills the turns one after another, as a prefill worker
    does (prefill only, then released), reuses: the snapshot policy's exact answer."""
    engine = build_engine(setup["config"], str(setup["model"]))
    hits = []
    for spec in specs:
        engine.add_request(Request(spec.id, list(spec.prompt_ids), greedy(1), spec.session,
                                   prefill_only=True))
        outs = []
        while not any(o.finished for o in outs):
            outs.extend(engine.step())
        hits.append(outs[-1].cached_tokens)
        engine.release(spec.id)
    return hits


def _metric(cluster, name: str) -> float:
    with urllib.request.urlopen(f"{cluster.http_address}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def _retries(cluster) -> float:
    return _metric(cluster, "baton_router_retries_total")


def _await_gone(pids: list[int], since: float) -> None:
    """Every pid exits (or is a zombie) within 5 s of `since`."""
    while any(alive(p) for p in pids) and time.monotonic() - since < 5:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]


def test_killing_one_prefill_stage_fails_over_and_leaves_no_orphans(setup):
    cluster = setup["cluster"]
    stage0 = cluster.procs[1]  # `baton serve`'s prefill worker: PP 3
    stages = children(stage0.pid)
    assert len(stages) == 2
    # prompts of 10-13 chunks: the kill lands while the PP-3 worker still computes one (with
    # 200-310 tokens a loaded run once saw its last request in the engine, killed the stage
    # after it was done, and nothing needed a retry)
    specs = [RequestSpec(f"k{i}", prompt_ids=prompt(50 + i, 600 + 20 * i), sampling=greedy(8))
             for i in range(12)]
    expected = tokens(local(setup, specs))
    info = next(w for w in list_workers(cluster.address) if pp_of(setup, w.worker_id) == 3)
    out: list = []
    runner = threading.Thread(target=lambda: out.extend(
        run_remote(cluster.address, specs, concurrency=12)))
    retries = _retries(cluster)
    before = worker_counters(info, cluster.secret.bearer)["prefilled_tokens"]
    runner.start()
    deadline = time.monotonic() + 20  # kill while the PP-3 worker holds a request
    while (now := worker_counters(info, cluster.secret.bearer))["engine_requests"] == 0:
        # what went wrong, if it did: the run's end, the PP-3 worker's work, the router's view
        assert time.monotonic() < deadline, (
            "the PP-3 prefill worker never held a request", runner.is_alive(), tokens(out),
            now["prefilled_tokens"] - before, [w.worker_id for w in list_workers(cluster.address)])
        time.sleep(0.01)
    os.kill(stages[-1], signal.SIGKILL)
    killed_at = time.monotonic()
    runner.join(timeout=120)
    assert tokens(out) == expected
    assert _retries(cluster) > retries  # requests in flight on the dead worker moved
    _await_gone([stage0.pid, *stages], killed_at)
    cluster.procs.remove(stage0)  # gone: the cluster's stop has nothing to stop there
    cluster.expected -= 1
    time.sleep(BASE["router"]["eject_after_seconds"] + 1)  # the router ejects the dead worker
    assert_clean(cluster)


def test_killing_one_decode_stage_mid_stream_moves_requests_and_leaves_no_orphans(setup):
    """Runs after the prefill-stage kill: prefill PP 1 and 2 are left, with decode PP 1 and 2."""
    cluster = setup["cluster"]
    info = next(w for w in list_workers(cluster.address)
                if w.role == baton_pb2.WORKER_ROLE_DECODE and pp_of(setup, w.worker_id) == 2)
    # `baton serve`'s decode worker (PP 2); the earlier kill shifted the list
    stage0 = next(p for p in cluster.procs if p.pid == int(info.worker_id.split("-")[-2]))
    stages = children(stage0.pid)
    assert len(stages) == 1
    specs = [RequestSpec(f"dk{i}", prompt_ids=prompt(90 + i, 40 + 13 * i), sampling=greedy(48))
             for i in range(12)]
    expected = tokens(local(setup, specs))
    out: list = []
    runner = threading.Thread(target=lambda: out.extend(
        run_remote(cluster.address, specs, concurrency=12)))
    retries = _retries(cluster)
    streamed = _metric(cluster, "baton_router_generation_tokens_total")
    runner.start()
    # kill while the PP-2 decode worker holds requests and tokens are streaming
    deadline = time.monotonic() + 30
    while (worker_counters(info, cluster.secret.bearer)["engine_requests"] == 0
           or _metric(cluster, "baton_router_generation_tokens_total") < streamed + 12):
        assert time.monotonic() < deadline and runner.is_alive(), \
            "the PP-2 decode worker never decoded a request"
        time.sleep(0.01)
    os.kill(stages[-1], signal.SIGKILL)
    killed_at = time.monotonic()
    runner.join(timeout=120)
    assert not runner.is_alive()
    assert tokens(out) == expected
    assert _retries(cluster) > retries  # requests in flight on the dead worker moved
    _await_gone([stage0.pid, *stages], killed_at)
    cluster.procs.remove(stage0)  # gone: the cluster's stop has nothing to stop there
    cluster.expected -= 1
    time.sleep(BASE["router"]["eject_after_seconds"] + 1)  # the router ejects the dead worker
    assert all(pp_of(setup, w.worker_id) != 2 or w.role != baton_pb2.WORKER_ROLE_DECODE
               for w in list_workers(cluster.address))
    assert_clean(cluster)
