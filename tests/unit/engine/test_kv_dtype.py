"""Engines with KV stored in bfloat16 or fp8 e4m3 (`cache.kv_dtype`, issue 50): the pool
stores the format (fp8 rows carry their scale), reuse on equals reuse off bit for bit (tokens
and logprobs, chunked alike), and the fast path's kernels agree with the reference path. NemotronH and Qwen3.5 (gated attention, rotary)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from baton.engine.request import Request
from baton.model.layers import linear
from tests.support.engine_helpers import (
    engine_for,
    greedy,
    make_checkpoint,
    prompt,
    run_all,
    run_alone,
)

FP8 = torch.float8_e4m3fn
POLICY = {"periodic_snapshot_interval": 16, "decode_end_snapshot": False}


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_5"])
def model_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"kv-{request.param}")
    if request.param == "qwen3_5":
        return make_checkpoint(root, "qwen", family="qwen3_5", pattern="GG*G", seed=4)
    return make_checkpoint(root, pattern="M*M-M", seed=4)


def _engine(model_dir, kv: str, reuse: bool = False, chunk: int = 64):
    return engine_for(model_dir, worker={"prefill_chunk_size": chunk},
                      cache={"tokens_per_block": 16, "enable_prefix_reuse": reuse,
                             "mamba_state_config": POLICY, "kv_dtype": kv})




@pytest.mark.parametrize("kv", ["model", "bfloat16", "float8_e4m3"])
def test_reuse_on_equals_reuse_off_bit_for_bit(model_dir, kv):
    a = prompt(1, 40)
    b = a[:32] + prompt(2, 21)
    # chunks of 16 (the snapshot interval): reuse off computes b in the chunks the reuse-on
    # run ends at its snapshot points, so the recurrent scans chunk alike and the bits must
    # agree (as they do with float32 KV)
    off, on = _engine(model_dir, kv, chunk=16), _engine(model_dir, kv, reuse=True, chunk=16)
    want = {"model": torch.float32, "bfloat16": torch.bfloat16, "float8_e4m3": FP8}[kv]
    assert on.pools.kv.dtype == want
    assert on.pools.kv.shape[-1] == on.pools.spec.head_dim + (4 if kv == "float8_e4m3" else 0)
    run_alone(off, "a", a)
    ref = run_alone(off, "b", b)
    run_alone(on, "a", a)
    got = run_alone(on, "b", b)
    assert got[2] == 32 and ref[2] == 0  # b reused a's first 32 tokens
    assert got[0] == ref[0] and got[1] == ref[1]  # tokens and logprobs, bit for bit
    if kv != "model":  # and the format really rounds: float32 KV gives other logprobs
        plain = _engine(model_dir, "model", chunk=16)
        run_alone(plain, "a", a)
        assert run_alone(plain, "b", b)[1] != ref[1]


def test_fast_path_agrees_with_the_reference_path(model_dir):
    reqs = [Request(f"r{i}", prompt(i, 20 + 23 * i), greedy(10)) for i in range(3)]
    out = {}
    for path in ("fast", "reference"):
        eng = _engine(model_dir, "float8_e4m3")
        scope = linear.reference_scope() if path == "reference" else contextlib.nullcontext()
        with scope:
            out[path] = run_all(eng, [Request(r.id, r.prompt_ids, r.sampling) for r in reqs])
    assert out["fast"]["tokens"] == out["reference"]["tokens"]


def test_block_bytes_follow_the_format(model_dir):
    sizes = {kv: _engine(model_dir, kv).pools.spec for kv in ("model", "bfloat16",
                                                              "float8_e4m3")}
    hd = sizes["model"].head_dim
    f32 = sizes["model"].kv_bytes_per_block()
    assert sizes["bfloat16"].kv_bytes_per_block() * 2 == f32
    assert sizes["float8_e4m3"].kv_bytes_per_block() * 4 * hd == f32 * (hd + 4)
    kv = _engine(model_dir, "float8_e4m3").pools.kv
    assert kv[0, 0].numel() * kv.element_size() * kv.shape[0] == \
        sizes["float8_e4m3"].kv_bytes_per_block()


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_5"])
def test_speculation_on_equals_off_with_fp8_kv(family, tmp_path):
    from tests.support.speculative_helpers import agreeing_checkpoint, agreeing_qwen_checkpoint

    ckpt = (agreeing_checkpoint if family == "nemotron_h" else agreeing_qwen_checkpoint)(tmp_path)
    cache = {"kv_dtype": "float8_e4m3", "num_state_slots": 160}

    def reqs():
        return [Request(f"r{i}", prompt(i, n), greedy(16)) for i, n in enumerate([3, 20, 45])]

    off = run_all(engine_for(ckpt, cache=cache), reqs())["tokens"]
    for spec in ({"num_draft_tokens": 2},
                 {"num_draft_tokens": 3, "tree": {"top_k": [2, 2, 1],
                                                  "max_total_draft_tokens": 6}}):
        eng = engine_for(ckpt, cache=cache, speculative=spec)
        assert eng.pools.kv.dtype == FP8
        assert run_all(eng, reqs())["tokens"] == off, spec


def test_disk_tier_with_fp8_kv_gives_reuse_off_tokens(model_dir, tmp_path):
    """Evicted snapshots go to the disk tier as bytes and come back into an fp8 pool."""

    def engine(tier: bool):
        cache = {"tokens_per_block": 16, "num_blocks": 40, "num_state_slots": 6,
                 "kv_dtype": "float8_e4m3", "enable_prefix_reuse": tier,
                 "mamba_state_config": {"additional_snapshot_offsets_from_end": [0],
                                        "decode_end_snapshot": True}}
        if tier:
            cache["tier"] = {"path": str(tmp_path / "tier"), "bytes": 64 << 20, "io": "file"}
        return engine_for(model_dir, cache=cache, worker={"max_num_seqs": 2})

    def chats(eng):
        history, toks = {s: [] for s in range(4)}, {}
        for t in range(3):
            for s in range(4):
                ids = history[s] + prompt(1000 * s + t, 20 + 3 * t)
                rid = f"s{s}t{t}"
                out = run_all(eng, [Request(rid, ids, greedy(6), session=f"s{s}")])
                toks[rid] = out["tokens"][rid]
                history[s] = ids + toks[rid]
        return toks

    eng = engine(True)
    assert chats(eng) == chats(engine(False))
    assert eng.cache.stats().tiers["disk"]["hits"] > 0
