"""16-bit state handoffs from and into tensor- and pipeline-parallel workers
(docs/state-precision.md, "Handoffs in 16 bits"), between separate processes through the
router: bf16 state with stochastic rounding and fp8 KV (issue 50's exactness suite with both
formats at once), the prompt end a rounding point, canaries armed.

One cluster: prefill workers TP 1, TP 2 and PP 2, decode workers TP 1, TP 2, PP 2 and a second
TP 1. Round-robin routing gives request t the pair (t mod 3, t mod 4): every twelve requests
cover all twelve pairs, among them prefill TP 2 -> decode TP 1 (refused per request before
the TP plan mapped 16-bit pieces), TP 1 -> TP 2, PP 2 -> TP 2 and TP 1 -> PP 2.

- Each prefill rank / stage narrows its own rounded state shard / layers into its own bf16
  snapshot slot (a mirrored slot copy) and sends from there; the TP plan maps the pieces in
  the snapshot pool's bytes. Each decode rank / stage receives into its own bf16 snapshot slot
  and widens it into the live slot with a mirrored copy before its next forward.
- Every handoff moved the state in 16 bits: each prefill worker's state bytes per handoff are
  its (rank 0's / stage 0's) bf16 slot bytes, half its float32 ones.
- Tokens equal `--local`'s (margin-filtered prompts: a TP all-reduce reorders float32 sums);
  pairs without a TP 2 worker also equal every logprob bit for bit.
With BATON_TEST_TP_X_PP=1 the PP-2 workers run TP 2 x PP 2 (not in the default suite: its
time budget).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from baton.cache import canary
from baton.client.local import run_local
from baton.client.remote import run_remote
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.model.partition import partition_layers
from tests.integration.cluster_helpers import assert_clean, start_cluster, write_config
from tests.integration.test_tp_cluster import MODEL, _spawn, explain, greedy
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = pytest.mark.integration

BASE = {
    "cache": {"num_blocks": 512, "num_state_slots": 64, "tokens_per_block": 16,
              "state_dtype": "bfloat16", "state_rounding": "stochastic",
              "state_rounding_seed": 7, "kv_dtype": "float8_e4m3",
              "mamba_state_config": {"periodic_snapshot_interval": 64,
                                     "additional_snapshot_offsets_from_end": [0]}},
    "router": {"policy": "round_robin", "eject_after_seconds": 3.0, "heartbeat_seconds": 0.5,
               "local_prefill_max_tokens": 0, "ship_decode_end_state": False},
    "worker": {"max_num_seqs": 16, "max_model_len": 512, "prefill_chunk_size": 64},
    "transfer": {"lease_seconds": 60.0},
}
TP_X_PP = os.environ.get("BATON_TEST_TP_X_PP") == "1"
"""Opt-in (suite time): the PP-2 prefill and decode workers run TP 2 x PP 2 instead."""
PP = ["--pipeline-parallel-size", "2", *(["--tensor-parallel-size", "2"] if TP_X_PP else [])]
EXTRA = [("prefill-worker", "p-tp2", ["--tensor-parallel-size", "2"]),
         ("prefill-worker", "p-pp2", PP),
         ("decode-worker", "d-tp2", ["--tensor-parallel-size", "2"]),
         ("decode-worker", "d-pp2", PP),
         ("decode-worker", "d-tp1b", [])]
"""Workers beside the cluster's own (prefill TP 1, decode TP 1)."""
STEPS = 6
MARGIN = 1e-3
PAIRS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("s16cluster")
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
        kind = {cluster.procs[1].pid: "p-tp1", cluster.procs[2].pid: "d-tp1"}
        kind.update({p.pid: k for p, (_, k, _) in zip(cluster.procs[3:], EXTRA, strict=True)})
        engine = build_engine(BatonConfig.from_dict(BASE), str(model))
        yield {"cluster": cluster, "model": model, "kind": kind, "engine": engine}
    finally:
        cluster.stop()


def _kind(setup, worker_id: str) -> str:
    return setup["kind"][int(worker_id.split("-")[-2])]


def _logprobs(result) -> list[float]:
    return [float(np.float32(x["logprob"] if isinstance(x, dict) else x.logprob))
            for x in result["logprobs"]]


def _kept(setup, n: int) -> tuple[list[RequestSpec], dict, dict, dict]:
    """n greedy requests whose local top-2 margins clear MARGIN at every step: (specs, local
    tokens, local logprobs, margins)."""
    specs, want, lps, margins = [], {}, {}, {}
    seed = 0
    while len(specs) < n:
        batch = [RequestSpec(f"s{seed + i}", prompt_ids=prompt(seed + i, 3 + (seed + i) % 37),
                             sampling=greedy(STEPS, logprobs=2)) for i in range(n)]
        seed += n
        for r in run_local(setup["engine"], batch, 16):
            m = [t["top"][0][1] - t["top"][1][1] for t in r["logprobs"]]
            if min(m) >= MARGIN and len(specs) < n:
                spec = next(s for s in batch if s.id == r["id"])
                specs.append(RequestSpec(spec.id, prompt_ids=spec.prompt_ids,
                                         sampling=greedy(STEPS, logprobs=1)))
                want[r["id"]], margins[r["id"]] = r["token_ids"], m
    for r in run_local(setup["engine"], specs, 16):  # logprobs as the cluster asks for them
        lps[r["id"]] = _logprobs(r)
    return specs, want, lps, margins


def test_16bit_handoffs_between_tp_and_pp_workers_equal_local(setup):
    cluster, engine = setup["cluster"], setup["engine"]
    specs, want, want_lps, margins = _kept(setup, 2 * PAIRS)
    remote = run_remote(cluster.address, specs, concurrency=6)
    got = {r["id"]: r.get("token_ids", r.get("error")) for r in remote}
    assert got == want, explain(got, want, margins)
    pairs: dict[tuple[str, str], int] = {}
    for r in remote:
        pair = (_kind(setup, r["prefill_worker"]), _kind(setup, r["decode_worker"]))
        pairs[pair] = pairs.get(pair, 0) + 1
        if not TP_X_PP and "tp2" not in pair[0] and "tp2" not in pair[1]:  # the same arithmetic: bit for bit
            assert _logprobs(r) == want_lps[r["id"]], (pair, r["id"])
    assert pairs == {(p, d): 2 for p in ("p-tp1", "p-tp2", "p-pp2")
                     for d in ("d-tp1", "d-tp2", "d-pp2", "d-tp1b")}
    counters = assert_clean(cluster)
    # every handoff moved 16-bit state: a prefill worker's state bytes per handoff are its
    # rank 0's / stage 0's bf16 slot bytes (its own layout; half the float32 ones)
    spec = engine.pools.spec
    f32, b16 = spec.state_bytes_per_slot(), spec.snapshot_bytes_per_slot()
    assert 2 * b16 == f32
    stage0 = partition_layers(engine.model.config.num_layers, 2)[0]
    share = sum(g in stage0 for g in spec.state_layers) / len(spec.state_layers)
    for wid, c in counters.items():
        assert c["canary_bad_blocks"] == 0 and c["canary_bad_slots"] == 0, (wid, c)
        kind = _kind(setup, wid)
        if not kind.startswith("p-"):
            continue
        assert c["handoffs"] == 8, (wid, c)
        per = {"p-tp1": b16, "p-tp2": c["state_bytes_per_snapshot"],
               "p-pp2": (c["state_bytes_per_snapshot"] if TP_X_PP else b16) * share}[kind]
        assert c["handoff_state_bytes_total"] == 8 * per, (wid, c)
        assert c["last_handoff_state_bytes"] == per, (wid, c)
        if kind == "p-tp2":
            assert per < b16  # rank 0's shard of the bf16 slot
