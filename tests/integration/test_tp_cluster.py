"""Tensor-parallel prefill and decode workers through the router, with heterogeneous TP moved
by NIXL between separate processes (every prefill rank writes its pieces into every decode
rank that needs them: `transfer/tp_route.py`).

One cluster for the module, on a NemotronH with n_groups 1 and one KV head (Mamba2 B/C and
KV replicated on every rank: the layout the peers' bugs came from): prefill workers TP 1 and
TP 2, decode workers TP 1, TP 2 and PP 2. Round-robin routing gives request number t the pair
(t mod 2, t mod 3), so every six consecutive requests cover all six pairs, among them the
three the issue names: prefill TP 2 -> decode TP 1, prefill TP 1 -> decode TP 2, prefill TP 2
-> decode PP 2 (and TP 2 -> TP 2, TP 1 -> PP 2, TP 1 -> TP 1 besides). Canaries are armed in
every worker: every free block and slot of every rank still holds its canary at the end.
With BATON_TEST_TP_X_PP=1 the prefill TP-2 and decode PP-2 workers run TP 2 x PP 2 (not in the
default suite: its time budget).

Prompts are margin-filtered: the local TP-1 engine's top-2 logprobs differ by at least MARGIN
at every greedy step, so a sum reordered by an all-reduce cannot flip a token; a differing
token is reported with the local margin.
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
from baton.engine.request import SamplingParams
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

MODEL = dict(pattern="M*M-M*", hidden_size=64, vocab_size=256, intermediate_size=128,
             mamba_head_dim=8, ssm_state_size=8, head_dim=16, chunk_size=16, n_groups=1,
             num_key_value_heads=1)
BASE = {
    "cache": {"num_blocks": 512, "num_state_slots": 128, "tokens_per_block": 16},
    "router": {"policy": "round_robin", "eject_after_seconds": 3.0, "heartbeat_seconds": 0.5,
               "local_prefill_max_tokens": 0, "ship_decode_end_state": False},
    "worker": {"max_num_seqs": 48, "max_model_len": 512, "prefill_chunk_size": 64},
    "transfer": {"lease_seconds": 60.0},
}
TP_X_PP = os.environ.get("BATON_TEST_TP_X_PP") == "1"
"""Opt-in (suite time): the prefill TP-2 and decode PP-2 workers run TP 2 x PP 2 instead (every
world rank its own transfer agent, driven through its stage leader)."""
BOTH = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
EXTRA = [("prefill-worker", "tp2", BOTH if TP_X_PP else ["--tensor-parallel-size", "2"]),
         ("decode-worker", "tp2", ["--tensor-parallel-size", "2"]),
         ("decode-worker", "pp2", BOTH if TP_X_PP else ["--pipeline-parallel-size", "2"])]
"""Workers beside the cluster's own (prefill TP 1, decode TP 1)."""
STEPS = 8
MARGIN = 1e-3
PAIRS = 6


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def _spawn(cluster, role: str, flags: list[str], model: Path, config: Path) -> None:
    env = {**os.environ, "BATON_CLUSTER_TOKEN": cluster.token, "BATON_NUM_THREADS": "1",
           canary.ENV: "1"}
    cmd = [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", role, "--router",
           cluster.address, "--model", str(model), "--config", str(config), *flags]
    cluster.procs.append(subprocess.Popen(cmd, start_new_session=True, env=env, stdout=2))
    cluster.expected += 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpcluster")
    model = make_checkpoint(root, seed=5, **MODEL)
    config = write_config(root / "base.yaml", BASE)
    env = pytest.MonkeyPatch()
    env.setenv(canary.ENV, "1")
    env.setenv("BATON_NUM_THREADS", "1")
    try:
        cluster = start_cluster(model, config, 1, 1)
    finally:
        env.undo()
    try:
        for role, _, flags in EXTRA:
            _spawn(cluster, role, flags, model, config)
        cluster.wait_ready(timeout=240)
        kind = {cluster.procs[1].pid: "tp1", cluster.procs[2].pid: "tp1"}
        kind.update({p.pid: k for p, (_, k, _) in zip(cluster.procs[3:], EXTRA, strict=True)})
        engine = build_engine(BatonConfig.from_dict(BASE), str(model))
        yield {"cluster": cluster, "model": model, "kind": kind, "engine": engine}
    finally:
        cluster.stop()


def kind_of(setup, worker_id: str) -> str:
    return setup["kind"][int(worker_id.split("-")[-2])]


def kept_specs(setup, prefix: str, n: int, first: int) -> tuple[list[RequestSpec], dict, dict]:
    """n margin-filtered greedy requests: (specs, local TP-1 tokens, local top-2 margins)."""
    specs, want, margins = [], {}, {}
    seed = first
    while len(specs) < n:
        batch = [RequestSpec(f"{prefix}{seed + i}", prompt_ids=prompt(seed + i, 3 + (seed + i) % 37),
                             sampling=greedy(STEPS, logprobs=2)) for i in range(n)]
        seed += n
        for r in run_local(setup["engine"], batch, 16):
            m = [t["top"][0][1] - t["top"][1][1] for t in r["logprobs"]]
            if min(m) >= MARGIN and len(specs) < n:
                spec = next(s for s in batch if s.id == r["id"])
                specs.append(RequestSpec(spec.id, prompt_ids=spec.prompt_ids,
                                         sampling=greedy(STEPS)))
                want[r["id"]], margins[r["id"]] = r["token_ids"], m
    return specs, want, margins


def tokens(results) -> dict:
    return {r["id"]: r.get("token_ids", r.get("error")) for r in results}


def explain(got: dict, want: dict, margins: dict) -> str:
    lines = []
    for k, w in want.items():
        g = got.get(k)
        if not isinstance(g, list):
            lines.append(f"{k}: {g}")
            continue
        i = next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        if i is not None:
            lines.append(f"{k} step {i}: got {g[i]}, want {w[i]}; local margin "
                         f"{margins[k][i]:.3g}")
    return "\n".join(lines)


def test_every_tp_pair_through_the_router_equals_local(setup):
    specs, want, margins = kept_specs(setup, "m", 16 * PAIRS, 0)
    remote = run_remote(setup["cluster"].address, specs, concurrency=48)
    got = tokens(remote)
    assert got == want, explain(got, want, margins)
    pairs: dict[tuple[str, str], int] = {}
    for r in remote:
        pair = (kind_of(setup, r["prefill_worker"]), kind_of(setup, r["decode_worker"]))
        pairs[pair] = pairs.get(pair, 0) + 1
    # every pair served 16 requests, the three among them
    assert pairs == {(p, d): 16 for p in ("tp1", "tp2") for d in ("tp1", "tp2", "pp2")}
    counters = assert_clean(setup["cluster"])
    for wid, c in counters.items():  # every rank's free blocks and slots were read back
        assert c["canary_bad_blocks"] == 0 and c["canary_bad_slots"] == 0, (wid, c)
        assert c["canary_blocks_checked"] == c["blocks_free"] > 0, (wid, c)
        assert c["canary_slots_checked"] > 0, (wid, c)


def test_constrained_greedy_output_through_tp_workers_equals_local(setup):
    """A grammar's answers through every pair, TP-2 prefill and decode among them: the
    prefill worker draws the first token under the grammar, the decode worker replays it into
    its own matcher; every token equals the local TP-1 engine's."""
    from baton.agents import grammar as g

    grammar = g.compile_text('start: "[" NUM ("," NUM){0,7} "]"\nNUM: /[0-9]{1,3}/',
                             "structured_outputs.grammar")
    specs = [RequestSpec(f"g{i}", prompt_ids=prompt(900 + i, 3 + 7 * i),
                         sampling=SamplingParams(max_tokens=32, grammar=grammar))
             for i in range(PAIRS)]
    want = tokens(run_local(setup["engine"], specs, PAIRS))
    remote = run_remote(setup["cluster"].address, specs, concurrency=1)
    assert tokens(remote) == want
    assert all(r["finish_reason"] in ("stop", "length") for r in remote)
    assert sum(r["finish_reason"] == "stop" for r in remote) >= PAIRS // 2  # closed brackets
    pairs = {(kind_of(setup, r["prefill_worker"]), kind_of(setup, r["decode_worker"]))
             for r in remote}
    assert pairs == {(p, d) for p in ("tp1", "tp2") for d in ("tp1", "tp2", "pp2")}


def _metric(cluster, name: str) -> float:
    with urllib.request.urlopen(f"{cluster.http_address}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def test_killing_one_decode_tp_rank_mid_stream_moves_requests_and_leaves_no_orphans(setup):
    cluster = setup["cluster"]
    info = next(w for w in list_workers(cluster.address, cluster.secret.bearer)
                if w.role == baton_pb2.WORKER_ROLE_DECODE and kind_of(setup, w.worker_id) == "tp2")
    rank0 = next(p for p in cluster.procs if p.pid == int(info.worker_id.split("-")[-2]))
    ranks = children(rank0.pid)
    assert len(ranks) == 1
    specs, want, margins = kept_specs(setup, "k", 12, 500)
    specs = [RequestSpec(s.id, prompt_ids=s.prompt_ids, sampling=greedy(48)) for s in specs]
    want = tokens(run_local(setup["engine"], specs, 12))
    out: list = []
    runner = threading.Thread(target=lambda: out.extend(
        run_remote(cluster.address, specs, concurrency=12)))
    retries = _metric(cluster, "baton_router_retries_total")
    streamed = _metric(cluster, "baton_router_generation_tokens_total")
    runner.start()
    deadline = time.monotonic() + 30  # kill while the TP-2 decode worker streams tokens
    while (worker_counters(info, cluster.secret.bearer)["engine_requests"] == 0
           or _metric(cluster, "baton_router_generation_tokens_total") < streamed + 12):
        assert time.monotonic() < deadline and runner.is_alive(), \
            "the TP-2 decode worker never decoded a request"
        time.sleep(0.01)
    os.kill(ranks[0], signal.SIGKILL)
    killed_at = time.monotonic()
    runner.join(timeout=120)
    assert not runner.is_alive()
    got = tokens(out)
    assert got == want, explain(got, want, {k: [0.0] * 48 for k in want})
    assert _metric(cluster, "baton_router_retries_total") > retries  # its requests moved
    while any(alive(p) for p in [rank0.pid, *ranks]) and time.monotonic() - killed_at < 5:
        time.sleep(0.05)
    assert not any(alive(p) for p in [rank0.pid, *ranks])  # no orphan rank
    cluster.procs.remove(rank0)
    cluster.expected -= 1
    time.sleep(BASE["router"]["eject_after_seconds"] + 1)  # the router ejects the dead worker
    assert all(kind_of(setup, w.worker_id) != "tp2" or w.role != baton_pb2.WORKER_ROLE_DECODE
               for w in list_workers(cluster.address, cluster.secret.bearer))
    assert_clean(cluster)
