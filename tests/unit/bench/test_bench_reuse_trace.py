"""`bench reuse --trace`: which requests a replay takes, how they scale, what the oracle is."""

from __future__ import annotations

import json

from bench.reuse_trace import SCALE, oracle, prompts, select

ROWS = [
    {"timestamp": 0, "input_length": 1000, "output_length": 100, "hash_ids": [1, 2]},
    {"timestamp": 5, "input_length": 600, "output_length": 10, "hash_ids": [9, 8]},
    {"timestamp": 9, "input_length": 1400, "output_length": 512, "hash_ids": [1, 2, 3]},
    {"timestamp": 12, "input_length": 300, "output_length": 3, "hash_ids": [7]},
]


def test_whole_conversations_in_trace_order(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    assert [r["timestamp"] for r in select(f, 1)] == [0, 9]  # conversation [1, ...] whole
    assert [r["timestamp"] for r in select(f, 2)] == [0, 9]
    assert [r["timestamp"] for r in select(f, 3)] == [0, 5, 9]


def test_scaled_prompts_share_tokens_where_the_trace_shares_blocks():
    reqs = prompts(ROWS, vocab=256)
    lengths = [len(t) for t, _ in reqs]
    assert lengths == [32, 19, 44, 10] and [o for _, o in reqs] == [3, 1, 16, 1]
    assert reqs[2][0][:32] == reqs[0][0] and reqs[1][0][:SCALE] != reqs[0][0][:SCALE]


def test_oracle_counts_what_no_earlier_prompt_shared():
    reqs = prompts(ROWS, vocab=256)
    computed, blocks = oracle(reqs)
    assert computed == 32 + 19 + (44 - 32) + 10
    assert blocks == 2 + 2 + 1 + 1


def test_cluster_replay_counts_snapshot_points_and_writes_a_valid_config(tmp_path):
    from baton.config import BatonConfig
    from bench.reuse_trace_cluster import config, snapshot_points

    reqs = prompts(ROWS, vocab=256)
    assert snapshot_points(reqs) == 4  # each prompt's end (all shorter than the 64 period)
    twice = reqs + [(reqs[0][0], 1)]
    assert snapshot_points(twice) == 4
    cfg = BatonConfig.from_dict(config(100, 8, "value", str(tmp_path)))
    assert cfg.cache.tier.path == str(tmp_path) and cfg.cache.eviction.policy == "value"
    assert cfg.router.policy == "prefix_aware" and cfg.cache.num_state_slots == 8
