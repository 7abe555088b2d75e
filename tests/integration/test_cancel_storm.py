"""200 requests cancelled at random points leave nothing behind (real processes, NIXL).

Router + 1 prefill + 1 decode worker, test canaries armed. Clients cancel gRPC Generate streams
(before the first token and mid-stream), let gRPC deadlines run out, disconnect from HTTP
streams, end HTTP answers with a stop string, and cancel follow-up turns that the decode worker
serves alone (Serve streams). Then, exactly:
  router   every `baton_router_tracked` gauge back at 0 (open worker streams and prefill calls,
           registry in-flight counts, peer watches, queue, shipments), busy threads back at
           their resting count (`baton_router_threads`; the pools keep their idle threads);
  workers  every `tracked_*` Stats counter at 0, busy threads (`baton_worker_threads`) back
           at their resting count, no block or slot held or quarantined, every free block and
           slot still holding its canary (`assert_clean`); the lease is long enough that
           nothing leaked is freed by expiry meanwhile;
and a request after the storm gets exactly the local engine's greedy tokens, over gRPC and HTTP.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.cache.canary import ENV as CANARY_ENV
from baton.client.local import run_local
from baton.client.remote import to_pb
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.proto_gen import router_pb2_grpc
from tests.integration.cluster_helpers import (
    assert_clean,
    list_workers,
    start_cluster,
    worker_counters,
    write_config,
)
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = pytest.mark.integration

N = 200
CONCURRENCY = 16
CONFIG = {
    "cache": {
        # room for every request in flight: nothing evicts the first turns' blocks and
        # snapshots, which the follow-ups restore; only finished turns leave a snapshot
        "num_blocks": 4096,
        "num_state_slots": 64,
        "mamba_state_config": {"periodic_snapshot_interval": 0,
                               "additional_snapshot_offsets_from_end": [],
                               "decode_end_snapshot": True},
    },
    "router": {"policy": "least_loaded", "heartbeat_seconds": 0.5, "eject_after_seconds": 10.0},
    "worker": {"max_num_seqs": 32, "max_model_len": 2048},
    # long: a reservation the cancellations leaked is still held when the test looks
    "transfer": {"lease_seconds": 120.0},
}
TURNS = 4
"""Finished first turns whose follow-ups (prompt + answer + 8 tokens) the decode worker serves
alone during the storm (router.local_prefill_max_tokens, on by default)."""


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cancel")
    model = make_checkpoint(root)
    old = os.environ.get(CANARY_ENV)
    os.environ[CANARY_ENV] = "1"  # the workers fill every free block and slot with canaries
    try:
        cluster = start_cluster(model, write_config(root / "baton.yaml", CONFIG), 1, 1)
    finally:
        if old is None:
            os.environ.pop(CANARY_ENV)
        else:
            os.environ[CANARY_ENV] = old
    ch = grpc.insecure_channel(cluster.address)
    yield {"cluster": cluster, "model": model, "stub": router_pb2_grpc.RouterStub(ch)}
    ch.close()
    cluster.stop()


# -- clients that give up -------------------------------------------------------------------

def grpc_cancel(ctx, i: int, rng: random.Random) -> int:
    """Cancels a Generate after k chunks (k = 0: after a few ms, during the prefill)."""
    k = rng.choice([0, 0, 1, 2, 5])
    length = 150 + rng.randrange(200) if k == 0 else 40 + rng.randrange(60)
    call = ctx["stub"].Generate(to_pb(RequestSpec(f"g{i}", prompt_ids=prompt(i, length),
                                                  sampling=greedy(200))), timeout=60)
    seen = 0
    if k == 0:
        time.sleep(rng.random() * 0.03)
    else:
        for _ in call:
            seen += 1
            if seen >= k:
                break
    call.cancel()
    return seen


def grpc_deadline(ctx, i: int, rng: random.Random) -> int:
    seen = 0
    spec = RequestSpec(f"d{i}", prompt_ids=prompt(i, 40 + rng.randrange(200)),
                       sampling=greedy(200))
    try:
        for _ in ctx["stub"].Generate(to_pb(spec), timeout=0.05 + rng.random() * 0.3):
            seen += 1
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
    return seen


def http_disconnect(ctx, i: int, rng: random.Random) -> int:
    """A streaming completion whose client goes away after k events (0: before any)."""
    k = rng.choice([0, 1, 3, 8])
    conn = _post(ctx, {"prompt": prompt(i, 40 + rng.randrange(200)), "max_tokens": 200,
                       "stream": True})
    seen = 0
    if k:
        resp = conn.getresponse()
        assert resp.status == 200
        while seen < k and resp.readline():
            seen += 1
    else:
        time.sleep(rng.random() * 0.03)
    conn.sock.close()  # an abrupt disconnect, as a killed client
    conn.close()
    return seen


def http_stop(ctx, i: int, rng: random.Random) -> int:
    """A stop string ends the answer early: the router cancels the rest of the request."""
    p, stop = ctx["stops"][i % len(ctx["stops"])]
    conn = _post(ctx, {"prompt": p, "max_tokens": 200, "stream": True, "stop": [stop]})
    body = conn.getresponse().read().decode()
    conn.close()
    assert body.endswith("data: [DONE]\n\n") and '"finish_reason":"stop"' in body, body[-300:]
    return 1


def serve_cancel(ctx, i: int, rng: random.Random) -> int:
    """A follow-up turn (the decode worker serves it alone) cancelled after k chunks."""
    history = ctx["turns"][i % TURNS]
    k = rng.choice([0, 1, 3])
    spec = RequestSpec(f"t{i}", prompt_ids=history + prompt(i, 8), sampling=greedy(200))
    call = ctx["stub"].Generate(to_pb(spec), timeout=60)
    seen = 0
    if k == 0:
        time.sleep(rng.random() * 0.01)
    else:
        for _ in call:
            seen += 1
            if seen >= k:
                break
    call.cancel()
    return seen


KINDS = (grpc_cancel, grpc_cancel, grpc_deadline, http_disconnect, http_disconnect, http_stop,
         serve_cancel)


def _post(ctx, body: dict) -> http.client.HTTPConnection:
    host, port = ctx["cluster"].http_address.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, **body}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    return conn


def storm(ctx, first: int, n: int) -> dict[str, list[int]]:
    """Requests first..first+n-1, CONCURRENCY at a time; the chunks each client saw, by kind."""
    seen: dict[str, list[int]] = {}
    errors: list[str] = []
    lock, slots, threads = threading.Lock(), threading.Semaphore(CONCURRENCY), []

    def one(i: int) -> None:
        try:
            rng = random.Random(i)
            kind = rng.choice(KINDS)
            got = kind(ctx, i, rng)
            with lock:
                seen.setdefault(kind.__name__, []).append(got)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{i}: {type(e).__name__}: {e}")
        finally:
            slots.release()

    for i in range(first, first + n):
        slots.acquire()
        t = threading.Thread(target=one, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(120)
    assert errors == []
    return seen


# -- what is held -------------------------------------------------------------------------

def router_state(cluster) -> dict[str, float]:
    """The router's debug gauges: tracked per-request state, busy threads, requests running."""
    out = {}
    for fam in scrape(cluster.http_address):
        for s in fam.samples:
            if s.name == "baton_router_tracked":
                out[s.labels["what"]] = s.value
            elif s.name == "baton_router_threads" and s.labels["kind"] == "busy":
                out["threads_busy"] = s.value
            elif s.name == "baton_router_requests_running":
                out["requests_running"] = s.value
    return out


def workers_state(cluster) -> dict[str, dict[str, float]]:
    """Per worker (one of each role here): every `tracked_*` Stats counter, what its cache
    holds, and its busy threads (metric `baton_worker_threads`)."""
    out = {}
    for w in list_workers(cluster.address, cluster.secret.bearer):
        role = w.worker_id.split("-")[0]
        c = worker_counters(w, cluster.secret.bearer)
        out[role] = {k: v for k, v in c.items()
                     if k.startswith("tracked_") or k in ("live_requests", "engine_requests")}
        (port,) = [p for r, p in cluster.metrics_ports if r == role]
        out[role]["threads_busy"] = next(
            s.value for fam in scrape(f"http://127.0.0.1:{port}") for s in fam.samples
            if s.name == "baton_worker_threads" and s.labels["kind"] == "busy")
    return out


def scrape(base: str):
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        return list(text_string_to_metric_families(r.read().decode()))


def at_rest(cluster, want=None, timeout: float = 15.0):
    """(router, workers) once nothing is held for a request any more and the busy threads
    stayed put for 0.5 s (given `want`: once equal to it), polled within `timeout`; the last
    reading otherwise (the assertions then show the difference)."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        now = router_state(cluster), workers_state(cluster)
        held = [k for k, v in now[0].items() if v and k != "threads_busy"] + [
            k for c in now[1].values() for k, v in c.items() if v and k != "threads_busy"]
        if not held and (now == want if want is not None else now == last):
            return now
        if time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.5)


def test_cancelled_requests_leave_nothing_behind(setup):
    cluster, stub = setup["cluster"], setup["stub"]
    engine = build_engine(BatonConfig.from_dict(CONFIG), str(setup["model"]))
    # first turns (served whole), and the answers whose text the stop strings cut
    firsts = [RequestSpec(f"first{j}", prompt_ids=prompt(9000 + j, 40), sampling=greedy(12))
              for j in range(TURNS)]
    stoppers = [RequestSpec(f"stop{j}", prompt_ids=prompt(9100 + j, 30), sampling=greedy(40))
                for j in range(8)]
    after = RequestSpec("after", prompt_ids=prompt(9999, 70), sampling=greedy(24))
    local = {r["id"]: r for r in run_local(engine, [*firsts, *stoppers, after])}
    turns = []
    for spec in firsts:
        got = [t for m in stub.Generate(to_pb(spec), timeout=60) for t in m.token_ids]
        assert got == local[spec.id]["token_ids"]
        turns.append(spec.prompt_ids + got)
    stops = []
    for spec in stoppers:
        text = local[spec.id]["text"]
        cut = next(j for j in range(5, len(text) - 2) if text[j:j + 2].strip())
        stops.append((spec.prompt_ids, text[cut:cut + 2]))
    ctx = {"cluster": cluster, "stub": stub, "turns": turns, "stops": stops}
    storm(ctx, N, 2 * CONCURRENCY)  # the thread pools grow to the storm's size first
    before = at_rest(cluster)
    assert before[0] == {"registry_inflight": 0, "peer_watches": 0, "queued": 0,
                         "shipments": 0, "worker_streams": 0, "prefill_calls": 0,
                         "requests_running": 0, "threads_busy": before[0]["threads_busy"]}
    paths_before = _decode_only(cluster)

    seen = storm(ctx, 0, N)

    # the storm hit every phase: before any token, mid-stream, and Serve streams
    assert sum(1 for kind in ("grpc_cancel", "http_disconnect") for n in seen[kind] if n == 0) \
        >= 20, seen
    assert sum(1 for kind in ("grpc_cancel", "http_disconnect") for n in seen[kind] if n > 0) \
        >= 20, seen
    assert len(seen["http_stop"]) >= 10 and len(seen["grpc_deadline"]) >= 10, seen
    assert _decode_only(cluster) - paths_before >= 10  # the follow-ups went to Serve
    router, workers = at_rest(cluster, want=before)
    assert changed(before[0], router) == {}
    assert set(workers) == set(before[1])
    assert {w: changed(before[1][w], c) for w, c in workers.items()} == {w: {} for w in workers}
    assert_clean(cluster)
    # and the cluster still answers exactly, over gRPC and HTTP
    got = [t for m in stub.Generate(to_pb(after), timeout=60) for t in m.token_ids]
    assert got == local["after"]["token_ids"]
    conn = _post(ctx, {"prompt": after.prompt_ids, "max_tokens": 24, "stream": False,
                       "return_token_ids": True})
    reply = json.loads(conn.getresponse().read())
    conn.close()
    assert reply["choices"][0]["token_ids"] == local["after"]["token_ids"]


def changed(before: dict, after: dict) -> dict:
    """{key: (before, after)} for every value that differs."""
    return {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys()
            if before.get(k) != after.get(k)}


def _decode_only(cluster) -> float:
    return sum(s.value for fam in scrape(cluster.http_address) for s in fam.samples
               if s.name == "baton_router_request_paths_total"
               and s.labels["path"] == "decode_only")
