"""Tiers through a real cluster (router, 2 prefill, 2 decode, prefix_aware): every worker has
a pool of 2 snapshots, one disk-tier folder shared by all four, and a shared Redis. Four chats
of three turns give the tokens of the colocated engine with reuse off; then Redis is stopped
and two more turns each still do: 0 wrong tokens, 0 failed requests, nothing leaked."""

from __future__ import annotations

import threading

import grpc
import pytest

from baton.client.local import run_local
from baton.client.remote import generate_one
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
from tests.support.redis_server import RedisServer, RedisUnavailable

pytestmark = pytest.mark.integration

SNAPSHOTS = {"additional_snapshot_offsets_from_end": [0], "decode_end_snapshot": True}


def config(tier_path, url) -> dict:
    return {
        "cache": {"num_blocks": 96, "num_state_slots": 6, "mamba_state_config": SNAPSHOTS,
                  "tier": {"path": str(tier_path), "bytes": 256 << 20},
                  "shared_store": {"url": url}},
        "router": {"policy": "prefix_aware", "heartbeat_seconds": 0.3,
                   "eject_after_seconds": 5.0, "local_prefill_max_tokens": 64},
        "worker": {"max_num_seqs": 4, "max_model_len": 1024, "max_batch_tokens": 64,
                   "prefill_chunk_size": 64},
        "transfer": {"lease_seconds": 60.0},
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers_cluster")
    srv = RedisServer("tiers-cluster-store-secret-0123")
    try:
        srv.start()
    except RedisUnavailable as e:
        pytest.skip(str(e))
    url = f"redis://:{srv.password}@127.0.0.1:{srv.port}/0"
    model = make_checkpoint(root)
    cluster = start_cluster(model, write_config(root / "baton.yaml", config(root / "tier", url)),
                            prefill=2, decode=2)
    ch = grpc.insecure_channel(cluster.address)
    yield {"cluster": cluster, "model": model, "stub": router_pb2_grpc.RouterStub(ch),
           "redis": srv}
    ch.close()
    cluster.stop()
    srv.stop()


def chats(setup, sessions: range, turns: range, history: dict) -> list:
    """Each session's turns in order (sessions in parallel threads); every result checked
    for errors."""
    out, lock = [], threading.Lock()

    def one(s):
        for t in turns:
            spec = RequestSpec(f"c{s}-t{t}", prompt_ids=history.get(s, []) + prompt(
                500 * s + t, 20), session=f"c{s}", sampling=SamplingParams(max_tokens=8,
                                                                          ignore_eos=True))
            res = generate_one(setup["stub"], spec)
            assert "error" not in res, res
            with lock:
                out.append((spec, res))
            history[s] = spec.prompt_ids + res["token_ids"]

    threads = [threading.Thread(target=one, args=(s,)) for s in sessions]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    return out


def reference(setup, specs) -> dict[str, list[int]]:
    cfg = BatonConfig.from_dict({"cache": {"enable_prefix_reuse": False}})
    engine = build_engine(cfg, str(setup["model"]))
    return {r["id"]: r["token_ids"] for r in run_local(engine, specs)}


def counters(cluster) -> list[dict]:
    return [worker_counters(w, cluster.secret.bearer) for w in list_workers(cluster.address)]


def test_small_pools_with_tiers_give_reuse_off_tokens_and_survive_redis_stopping(setup):
    cluster, history = setup["cluster"], {}
    first = chats(setup, range(4), range(3), history)
    assert len(first) == 12
    assert {s.id: r["token_ids"] for s, r in first} == reference(setup, [s for s, _ in first])
    c = counters(cluster)
    tier_hits = sum(x.get("tier_disk_hits", 0) + x.get("tier_shared_hits", 0) for x in c)
    assert tier_hits > 0, c
    assert sum(x.get("tier_disk_admitted", 0) for x in c) > 0
    setup["redis"].stop()  # the shared store goes away mid-run
    second = chats(setup, range(4), range(3, 5), history)
    assert len(second) == 8
    assert {s.id: r["token_ids"] for s, r in second} == reference(setup, [s for s, _ in second])
    assert all(x.get("tier_disk_corrupt", 0) == 0 for x in counters(cluster))
    assert_clean(cluster)
