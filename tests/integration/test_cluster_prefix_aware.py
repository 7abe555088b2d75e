"""prefix_aware routing on real workers: a prefix counts only where a snapshot exists."""

from __future__ import annotations

import time

import pytest

from baton.client.remote import run_remote
from baton.client.requests import RequestSpec
from baton.engine.request import SamplingParams
from baton.proto_gen import baton_pb2
from tests.integration.cluster_helpers import list_workers, start_cluster, write_config
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = pytest.mark.integration

CONFIG = {
    "cache": {
        "num_blocks": 512,
        "num_state_slots": 48,
        "mamba_state_config": {
            "periodic_snapshot_interval": 32,
            "additional_snapshot_offsets_from_end": [0],
            "decode_end_snapshot": False,
        },
    },
    "router": {"policy": "prefix_aware", "heartbeat_seconds": 0.3, "eject_after_seconds": 20.0},
    "worker": {"max_num_seqs": 8, "max_model_len": 1024},
    # whole-request handoffs after the first token (the default); test_handoff streams layers
    "transfer": {"layerwise": False},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_aware")
    c = start_cluster(make_checkpoint(root), write_config(root / "c.yaml", CONFIG), 2, 1)
    yield c
    c.stop()


def _tracked(address: str) -> dict[str, int]:
    return {
        w.worker_id: w.tracked_snapshots
        for w in list_workers(address)
        if w.role == baton_pb2.WORKER_ROLE_PREFILL
    }


def test_requests_follow_the_worker_holding_the_snapshot(cluster):
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    base = prompt(4242, 96)
    (first,) = run_remote(cluster.address, [RequestSpec("a", prompt_ids=base + [7, 8], sampling=sp)])
    holder = first["prefill_worker"]
    deadline = time.monotonic() + 20
    while _tracked(cluster.address).get(holder, 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    tracked = _tracked(cluster.address)
    # snapshots at 32, 64, 96 and the prompt end (98) reached the router by heartbeat
    assert tracked[holder] == 4 and sum(tracked.values()) == 4, tracked
    followers = [
        RequestSpec(f"b{i}", prompt_ids=base + prompt(5000 + i, 6), sampling=sp) for i in range(4)
    ]
    res = run_remote(cluster.address, followers)
    assert [r["prefill_worker"] for r in res] == [holder] * 4
    assert [r["cached_tokens"] for r in res] == [96] * 4
