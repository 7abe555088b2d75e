"""`baton bench precision`: chunks end at the rounding points; the byte columns follow the
formats; float32 is its own reference (KL 0), fp8 KV is not; every row has its columns."""

from __future__ import annotations

import pytest

from bench import precision

pytestmark = pytest.mark.usefixtures("model_single_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from baton.model.make_model import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("p") / "m", seed=0, tokenizer=True)


def test_chunks_end_at_the_rounding_points():
    assert precision._chunk_ends(600, (256, 512, 600)) == [256, 512, 600]
    assert precision._chunk_ends(300, (100,)) == [100, 300]
    assert precision._chunk_ends(513, ()) == [256, 512, 513]


def test_rows(model_dir, monkeypatch):
    monkeypatch.setattr(precision, "ROUNDS", 1)
    rows = {r["variant"]: r for r in precision.measure(model_dir, (64,), 1, (2, 32, 16),
                                                       handoff_reps=0)}
    assert list(rows) == list(precision.VARIANTS)
    f32, fp8, bf16 = rows["float32"], rows["kv fp8"], rows["kv bf16"]
    assert bf16["kv_bytes_2k"] * 2 == f32["kv_bytes_2k"]
    assert fp8["handoff_bytes_2k"] - fp8["state_format_bytes"] == fp8["kv_bytes_2k"]
    assert rows["state bf16 stochastic"]["state_format_bytes"] * 2 == f32["state_format_bytes"]
    assert rows["state bf16 stochastic"]["snapshots_per_gib"] >= 2 * f32["snapshots_per_gib"]
    assert fp8["kl_64"] > 0 and 0 < fp8["top1_64"] <= 1
    # below the first rounding point (256) a rounded state has not rounded yet
    assert rows["state fp16 nearest"]["kl_64"] == 0.0
    for name in precision.DECODE_VARIANTS:
        assert rows[name]["decode_tok_per_cpu_s"] > 0
    assert f32["decode_ratio"] == 1.0


def test_handoff_times_move_half_the_state_bytes(model_dir):
    """Two processes over NIXL: a 2k prompt's handoff with bf16 state moves exactly half the
    float32 state's bytes (the KV the same); every handoff is delivered and timed."""
    from baton.model.config import load_config
    from baton.model.pools import PoolSpec

    ho = precision.handoff_times(model_dir, reps=1, kv_bf16=False)
    spec = PoolSpec.for_model(load_config(model_dir), num_blocks=1, tokens_per_block=16,
                              num_slots=1)
    half = spec.state_bytes_per_slot() // 2
    assert ho["float32"][1] - ho["bfloat16"][1] == half
    assert ho["float32"][1] == 128 * spec.kv_bytes_per_block() + spec.state_bytes_per_slot()
    assert all(v[0] > 0 for k, v in ho.items() if k != "staging_s") and ho["staging_s"] > 0
