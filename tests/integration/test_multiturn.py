"""Multi-turn chats across prefill and decode: the decode-end snapshot is reused, not stranded.

One cluster (router, 2 prefill, 2 decode, prefix_aware; snapshots at each prompt end and at
each decode end) for the module; the decode-worker kill runs last because it changes it.
Turn 1 of a chat goes through a prefill worker; from turn 2 the decode worker holding the
previous turn's decode-end snapshot serves the short increment alone (conditional
disaggregation). Every token is checked against the colocated engine with reuse off.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from baton.client.local import run_local
from baton.client.remote import generate_one
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.proto_gen import baton_pb2, router_pb2_grpc
from tests.integration.cluster_helpers import (
    assert_clean,
    list_workers,
    start_cluster,
    worker_counters,
    write_config,
)
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = pytest.mark.integration

LIMIT = 64
"""router.local_prefill_max_tokens here: a 20-token message is served by the decode worker,
a 100-token one goes through a prefill worker."""

CONFIG = {
    "cache": {
        "num_blocks": 1024,
        "num_state_slots": 96,
        "mamba_state_config": {
            "periodic_snapshot_interval": 0,
            "additional_snapshot_offsets_from_end": [0],
            "decode_end_snapshot": True,
        },
    },
    "router": {"policy": "prefix_aware", "heartbeat_seconds": 0.3, "eject_after_seconds": 3.0,
               "local_prefill_max_tokens": LIMIT},
    "worker": {"max_num_seqs": 32, "max_model_len": 2048, "max_batch_tokens": 64,
               "prefill_chunk_size": 64},
    "transfer": {"lease_seconds": 60.0},
}
NO_REUSE = {**CONFIG, "cache": {**CONFIG["cache"], "enable_prefix_reuse": False}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    model = make_checkpoint(root)
    cluster = start_cluster(model, write_config(root / "baton.yaml", CONFIG), prefill=2, decode=2)
    ch = grpc.insecure_channel(cluster.address)
    yield {"cluster": cluster, "model": model, "stub": router_pb2_grpc.RouterStub(ch)}
    ch.close()
    cluster.stop()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def local_tokens(setup, specs) -> dict[str, list[int]]:
    engine = build_engine(BatonConfig.from_dict(NO_REUSE), str(setup["model"]))
    return {r["id"]: r["token_ids"] for r in run_local(engine, specs)}


def chat(setup, session: str, messages: list[list[int]], answer: int = 8,
         between=None) -> list[tuple[RequestSpec, dict]]:
    """The turns of one chat in order: each prompt is the history plus the next message."""
    history: list[int] = []
    out = []
    for turn, msg in enumerate(messages):
        if between is not None:
            between(turn)
        spec = RequestSpec(f"{session}-t{turn}", prompt_ids=history + msg, session=session,
                           sampling=greedy(answer))
        res = generate_one(setup["stub"], spec)
        assert "error" not in res, res
        out.append((spec, res))
        history = spec.prompt_ids + res["token_ids"]
    return out


def path_counts(cluster) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"{cluster.http_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith("baton_router_request_paths_total{"):
            labels, value = line[len("baton_router_request_paths_total{"):].split("} ")
            kv = dict(p.split("=") for p in labels.split(","))
            counts[(kv["path"].strip('"'), kv["reason"].strip('"'))] = float(value)
    return counts


def test_eight_six_turn_chats_reuse_the_decode_end_state(setup):
    cluster = setup["cluster"]
    results: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda s=s: results.update(
            {s: chat(setup, f"chat{s}", [prompt(1000 * s + t, 20) for t in range(6)])}))
        for s in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 8
    turns = [pair for s in range(8) for pair in results[s]]
    assert {s.id: r["token_ids"] for s, r in turns} == local_tokens(setup, [s for s, _ in turns])
    for s in range(8):
        (spec0, first), *rest = results[s]
        assert first["cached_tokens"] == 0 and first["prefill_worker"], first
        prev_spec = spec0
        for spec, res in rest:
            # the whole previous turn (prompt + answer) was restored on the serving worker
            assert res["cached_tokens"] >= len(prev_spec.prompt_ids) + 8 - 1, (spec.id, res)
            assert res["prefill_worker"] == "" and res["decode_worker"] == first["decode_worker"]
            prev_spec = spec
    counts = path_counts(cluster)
    assert counts[("decode_only", "decode_snapshot")] >= 40, counts
    decode = [w for w in list_workers(cluster.address) if w.role == baton_pb2.WORKER_ROLE_DECODE]
    stats = [worker_counters(w, cluster.secret.bearer) for w in decode]
    # 40 local turns, each prefilling its 20-token message only (the rest was restored)
    assert sum(c["local_requests"] for c in stats) == 40
    assert sum(c["prefilled_tokens"] for c in stats) == 40 * 20
    assert sum(c["hit_tokens"] for c in stats) == sum(r["cached_tokens"] for _, r in turns)
    assert_clean(cluster)


def adopted_by(cluster) -> dict[str, float]:
    """Per prefill worker: decode-end snapshots it adopted (shipped back by decode workers)."""
    return {w.worker_id: worker_counters(w, cluster.secret.bearer)["snapshots_adopted"]
            for w in list_workers(cluster.address) if w.role == baton_pb2.WORKER_ROLE_PREFILL}


def adopted(cluster) -> float:
    """Decode-end snapshots the prefill workers adopted (shipped back by decode workers)."""
    return sum(adopted_by(cluster).values())


def wait_adopted(cluster, n: float) -> None:
    deadline = time.monotonic() + 20
    while adopted(cluster) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert adopted(cluster) >= n


def test_an_increment_over_the_limit_goes_through_a_prefill_worker(setup):
    cluster = setup["cluster"]
    before = adopted(cluster)
    # turn 2 runs on the decode worker alone; its decode-end state is shipped back to the
    # prefill worker of turn 1 in the background (after each turn: two shipments)
    turns = chat(setup, "big", [prompt(77, 30), prompt(78, 20)],
                 between=lambda t: wait_adopted(cluster, before + t))
    wait_adopted(cluster, before + 2)
    history = turns[1][0].prompt_ids + turns[1][1]["token_ids"]
    spec = RequestSpec("big-t2", prompt_ids=history + prompt(79, LIMIT + 36), session="big",
                       sampling=greedy(8))
    r2 = generate_one(setup["stub"], spec)
    (s0, r0), (s1, r1) = turns
    assert r1["prefill_worker"] == "" and r1["cached_tokens"] == 30 + 8
    assert r2["prefill_worker"] != "", r2
    # the prefill worker of turn 1 restores the whole of turn 2 (30 + 8 + 20 + 8 tokens),
    # shipped back to it
    assert r2["prefill_worker"] == r0["prefill_worker"] and r2["cached_tokens"] == 66, r2
    assert {s.id: r["token_ids"] for s, r in [*turns, (spec, r2)]} == \
        local_tokens(setup, [s0, s1, spec])
    assert path_counts(cluster)[("prefill_decode", "increment_too_large")] >= 1
    assert_clean(cluster)


def test_decodes_keep_pace_while_their_worker_prefills_increments(setup):
    """Inter-token latency p99 of a long decode with and without local prefills beside it on
    its decode worker (a generous bound: this machine is shared; the benchmark measures)."""
    stub = setup["stub"]
    owner = chat(setup, "long", [prompt(600, 20)], answer=4)
    decode = owner[0][1]["decode_worker"]
    # sessions whose snapshots sit on the same decode worker
    peers = []
    for s in range(40):
        if len(peers) == 3:
            break
        (spec, res), = chat(setup, f"peer{s}", [prompt(700 + s, 20)], answer=2)
        if res["decode_worker"] == decode:
            peers.append(spec.prompt_ids + res["token_ids"])
    assert len(peers) == 3

    def gaps(stream_spec, during=None) -> list[float]:
        from baton.client.remote import to_pb
        gaps, last, n, started = [], None, 0, False
        for msg in stub.Generate(to_pb(stream_spec), timeout=120):
            now, k = time.perf_counter(), len(msg.token_ids)
            if last is not None and k and n >= 20:  # a message of k tokens covers k gaps
                gaps.extend([(now - last) / k] * k)
            if k:
                last, n = now, n + k
            if during is not None and n >= 20 and not started:
                started = True
                during.start()
        return gaps

    history = owner[0][0].prompt_ids + owner[0][1]["token_ids"]
    # A stream whose reader falls behind the engine gets its tokens in fewer, larger messages
    # (`drain_chunk`); a run starved that long (a loaded CI machine once gave every token past
    # the 20th in one message) measures no gaps, so it is measured again, with the same tokens.
    for attempt in range(3):
        alone = gaps(RequestSpec(f"long-a{attempt}", prompt_ids=history + prompt(601, 20),
                                 session="long", sampling=greedy(120)))
        if len(alone) >= 50:
            break
    assert len(alone) >= 50, f"3 runs alone streamed too few messages to time: {len(alone)}"
    served = []

    def prefill_increments():
        for i, h in enumerate(peers):  # each a local prefill of LIMIT tokens on `decode`
            spec = RequestSpec(f"peer-inc{i}", prompt_ids=h + prompt(800 + i, LIMIT),
                               sampling=greedy(2))
            served.append(generate_one(stub, spec))

    side = threading.Thread(target=prefill_increments)
    busy = gaps(RequestSpec("long-b", prompt_ids=history + prompt(602, 20), session="long",
                            sampling=greedy(120)), during=side)
    side.join(timeout=60)
    assert busy, "the run beside the prefills streamed its tokens in one message: nothing to time"
    assert [r["prefill_worker"] for r in served] == ["", "", ""], served
    assert {r["decode_worker"] for r in served} == {decode}

    def p99(xs):
        return sorted(xs)[int(0.99 * (len(xs) - 1))]

    def mean(xs):
        return sum(xs) / len(xs)

    print(f"ITL alone mean {mean(alone) * 1e3:.1f} ms p99 {p99(alone) * 1e3:.1f} ms; with "
          f"local prefills mean {mean(busy) * 1e3:.1f} ms p99 {p99(busy) * 1e3:.1f} ms")
    # the pace (mean inter-token latency) within 2x; p99 within 2x plus a generous 250 ms for
    # this shared 2-core machine, where a scheduler hiccup alone makes a p99 (the benchmark
    # has the tight figure). On this CPU tiny model a step that also prefills a chunk runs a
    # second forward, so that step's gap alone is 2-5x a decode step's.
    assert mean(busy) <= 2 * mean(alone) + 0.01, (mean(busy), mean(alone))
    assert p99(busy) <= 2 * p99(alone) + 0.25, (p99(busy), p99(alone))


def test_a_killed_decode_worker_moves_the_session(setup):
    """Runs last: kills the decode worker that holds the chat; the next turns are exact and
    reuse what the survivors hold."""
    cluster = setup["cluster"]
    messages = [prompt(900 + t, 20) for t in range(4)]

    before_by = adopted_by(cluster)
    before = sum(before_by.values())
    got: dict[str, float] = {}

    def kill_holder(turn):
        if turn != 2:
            return
        wait_adopted(cluster, before + 2)  # turn 2's decode-end state reached a prefill worker
        got.update(adopted_by(cluster))
        holder = done[1][1]["decode_worker"]
        pid = int(holder.split("-")[-2])
        victim = next(p for p in cluster.procs if p.pid == pid)
        victim.kill()
        victim.wait()

    done: list = []
    history: list[int] = []
    for turn, msg in enumerate(messages):
        kill_holder(turn)
        spec = RequestSpec(f"kill-t{turn}", prompt_ids=history + msg, session="kill",
                           sampling=greedy(8))
        res = generate_one(setup["stub"], spec)
        assert "error" not in res, res
        done.append((spec, res))
        history = spec.prompt_ids + res["token_ids"]
    (s0, r0), (s1, r1), (s2, r2), (s3, r3) = done
    assert r1["prefill_worker"] == "" and r1["cached_tokens"] == 20 + 8
    # turn 3: the holder is gone. A prefill worker holds turn 2's decode-end state, shipped
    # back before the kill: 20 + 8 + 20 + 8 tokens; the one that computed turn 1 holds turn 1's
    # prompt (20). The router prefers the deeper one unless it is busier than the other by more
    # than router.prefix_load_slack (a shipment still landing counts): the worker's own match
    # decides what is skipped, exactly.
    grew = {w for w, n in got.items() if n > before_by.get(w, 0)}

    def brief(r):
        return {k: r[k] for k in ("prefill_worker", "decode_worker", "cached_tokens")}

    # the snapshot boundaries a survivor can hold: turn 1's prompt end (20), turn 1's decode
    # end (28, shipped), turn 2's decode end (56, shipped)
    why = ([brief(r) for r in (r0, r1, r2)], before_by, got)
    assert grew, why
    if r2["prefill_worker"] in grew:
        assert r2["cached_tokens"] in (28, 56), why
    else:
        assert r2["prefill_worker"] == r0["prefill_worker"] and r2["cached_tokens"] == 20, why
    assert r2["decode_worker"] != r1["decode_worker"]
    # turn 4: back on the surviving decode worker, from turn 3's decode-end snapshot
    assert r3["prefill_worker"] == "" and r3["decode_worker"] == r2["decode_worker"]
    assert r3["cached_tokens"] == len(s2.prompt_ids) + 8
    assert {s.id: r["token_ids"] for s, r in done} == local_tokens(setup, [s0, s1, s2, s3])
    deadline = time.monotonic() + 15
    while len(list_workers(cluster.address)) != 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_clean(cluster)
