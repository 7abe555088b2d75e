"""A quantized checkpoint (NemotronH MoE in ModelOpt's MIXED_PRECISION layout: routed experts
NVFP4, the other projections FP8, attention bf16, as Nemotron 3 Super ships) through a 1P+1D
cluster and a TP 2 engine gives `--local`'s greedy tokens; the workers report its format. The
float checkpoint served with `--quantize int8` / `int4` (weights packed in memory, read as
stored by the CPU kernels) through 1P+1D gives `--local --quantize`'s tokens. Under TP 2 (rank
processes) and PP 2 (stage processes) the weights stay packed: Qwen's 128 x 128 FP8, a
`baton quantize` int4 checkpoint and `--quantize int8` give the single-process engine's
tokens, and so do a TP 2 prefill worker and a PP 2 decode worker of a cluster with
`--quantize int8`; PP 2 speculates with a ModelOpt FP8 MTP head; a TP size that cuts an int4
group is refused in one line, no rank left running."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from baton.client.remote import run_remote
from baton.client.requests import RequestSpec
from baton.engine.request import Request
from baton.errors import ConfigError
from baton.model.loader import load_model
from baton.model.make_model import write_checkpoint
from baton.model.quant.quantize import write_quantized
from bench import quant_layouts
from tests.integration.cluster_helpers import (
    assert_clean,
    list_workers,
    start_cluster,
    write_config,
)
from tests.integration.test_tp_engine import MARGIN, greedy_margins
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all
from tests.unit.model.quant.test_tp_packed import QWEN128

pytestmark = pytest.mark.integration

NH_MOE = dict(pattern="M*ME", vocab_size=256, hidden_size=64, intermediate_size=128,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
              mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=16,
              moe_intermediate_size=64, moe_shared_expert_intermediate_size=64)
CONFIG = {"cache": {"num_blocks": 256, "num_state_slots": 32, "enable_prefix_reuse": False},
          "worker": {"max_num_seqs": 8, "max_model_len": 1024, "prefill_chunk_size": 32}}
LENGTHS = [1, 5, 17, 33, 60, 90]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantcluster")
    src = make_checkpoint(root, "f", seed=3, **NH_MOE)
    return src, quant_layouts.write(src, root / "mixed", "modelopt_mixed")


@pytest.fixture(scope="module")
def model(dirs):
    return dirs[1]


def local_tokens(model, specs, quantize=None, weights: list | None = None, **worker):
    eng = engine_for(model, cache=CONFIG["cache"], worker={**CONFIG["worker"], **worker},
                     model={"quantize": quantize})
    if weights is not None:
        weights.append(str(eng.weights))
    reqs = [Request(s.id, list(s.prompt_ids), s.sampling) for s in specs]
    try:
        return run_all(eng, reqs)["tokens"]
    finally:
        if hasattr(eng.model, "close"):  # a TP engine's ranks and process group
            eng.model.close()


@pytest.mark.parametrize("served,quantize,fmt", [("mixed", None, "mixed_fp8_nvfp4"),
                                                 ("float", "int8", "w8a16_channel"),
                                                 ("float", "int4", "w4a16_g32")])
def test_one_prefill_one_decode_equals_local(dirs, served, quantize, fmt, tmp_path):
    model = dirs[served == "mixed"]
    specs = [RequestSpec(f"q{i}", prompt_ids=prompt(i, n), sampling=greedy(8))
             for i, n in enumerate(LENGTHS)]
    flags = ("--quantize", quantize) if quantize else ()
    cluster = start_cluster(model, write_config(tmp_path / "c.yaml", CONFIG), 1, 1, flags)
    try:
        remote = run_remote(cluster.address, specs, concurrency=4)
        counters = assert_clean(cluster)
    finally:
        cluster.stop()
    assert {r["id"]: r.get("token_ids", r.get("error")) for r in remote} == \
        local_tokens(model, specs, quantize)
    for wid, c in counters.items():
        assert c[f"weight_format.{fmt}"] == 1.0 and c["weight_bytes"] > 0, wid


def test_tp2_equals_tp1(model):
    ref = load_model(model)
    kept = []
    for i, n in enumerate(LENGTHS):
        _, steps = greedy_margins(ref, prompt(i, n), 8)
        if min(m for _, _, m in steps) >= MARGIN:
            kept.append(RequestSpec(f"t{i}", prompt_ids=prompt(i, n), sampling=greedy(8)))
    assert len(kept) >= 4
    held: list[str] = []
    assert local_tokens(model, kept, None, held, tensor_parallel_size=2) == \
        local_tokens(model, kept)
    assert "held in packed fp8 / nvfp4 and float32" in held[0], held  # each rank's shard


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Qwen3.5 whose TP 2 shards are whole 128 x 128 tiles: float, Qwen FP8, int4 written."""
    root = tmp_path_factory.mktemp("quantqwen")
    src = write_checkpoint(root / "f", seed=1, **QWEN128)
    return {"float": src, "qwen_fp8": quant_layouts.write(src, root / "fp8", "qwen_fp8"),
            "int4": write_quantized(src, root / "int4", "int4")}


SPLIT = [("qwen_fp8", None, "tensor_parallel_size", "fp8"),
         ("int4", None, "tensor_parallel_size", "int4"),
         ("float", "int8", "tensor_parallel_size", "int8"),
         ("float", "int8", "pipeline_parallel_size", "int8")]


@pytest.mark.parametrize("served,quantize,split,kind", SPLIT,
                         ids=[f"{s[0]}-{s[1] or 'stored'}-{s[2][0]}p2" for s in SPLIT])
def test_split_worker_keeps_weights_packed_and_equals_one_process(qwen, served, quantize,
                                                                  split, kind):
    path = qwen[served]
    kept, want = _reference(path, quantize)
    held: list[str] = []
    assert local_tokens(path, kept, quantize, held, **{split: 2}) == want
    assert f"held in packed {kind} and float32" in held[0], held


_REFERENCE: dict = {}


def _reference(path, quantize) -> tuple[list[RequestSpec], dict]:
    """(the prompts whose every greedy step the single-process model wins by MARGIN (TP: the
    all-reduce sums in its own order), the single-process engine's tokens), once a model."""
    key = (str(path), quantize)
    if key not in _REFERENCE:
        ref = load_model(path, quantize=quantize)
        kept = []
        for i, n in enumerate(LENGTHS):
            _, steps = greedy_margins(ref, prompt(i, n), 8)
            if min(m for _, _, m in steps) >= MARGIN:
                kept.append(RequestSpec(f"s{i}", prompt_ids=prompt(i, n), sampling=greedy(8)))
        assert len(kept) >= 4
        _REFERENCE[key] = kept, local_tokens(path, kept, quantize)
    return _REFERENCE[key]


def test_tp_size_that_cuts_a_group_is_refused(tmp_path):
    path = write_checkpoint(tmp_path / "f", seed=1, **{**QWEN128, "intermediate_size": 96})
    with pytest.raises(ConfigError) as e:
        engine_for(path, model={"quantize": "int4"}, worker={"tensor_parallel_size": 2})
    msg = str(e.value)
    assert "\n" not in msg and "tensor_parallel_size=2" in msg and "[128, 96]" in msg, msg
    assert "groups of 32" in msg, msg
    ps = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "pid=,args="],
                        capture_output=True, text=True).stdout
    assert "baton.engine.tp" not in ps, ps  # nothing half-loaded keeps running
    import torch.distributed as dist

    assert not dist.is_initialized()  # this process left the ranks' group too


def test_pp2_speculating_with_an_fp8_mtp_head_equals_one_process(tmp_path):
    # ModelOpt FP8 quantizes the MTP head's projections too: the last stage holds the head
    # packed as stored (tests/unit/model/quant/test_tp_packed.py) and drafts with it
    from baton.model.quant import open_checkpoint
    from tests.support.speculative_helpers import agreeing_checkpoint

    q = quant_layouts.write(agreeing_checkpoint(tmp_path), tmp_path / "q", "modelopt_fp8")
    assert any(e.startswith("mtp.") for e in open_checkpoint(q).entries)
    specs = [RequestSpec(f"m{i}", prompt_ids=prompt(i, n), sampling=greedy(10))
             for i, n in enumerate(LENGTHS[:4])]
    eng = engine_for(q, cache=CONFIG["cache"], speculative={"num_draft_tokens": 3},
                     worker={**CONFIG["worker"], "pipeline_parallel_size": 2,
                             "pp_layer_partition": [6, 2]})
    reqs = [Request(s.id, list(s.prompt_ids), s.sampling) for s in specs]
    try:
        out = run_all(eng, reqs)
    finally:
        eng.model.close()
    assert out["tokens"] == local_tokens(q, specs)
    assert sum(o.accepted_tokens for o in out["outputs"].values()) > 0


def test_tp2_prefill_and_pp2_decode_workers_quantizing_equal_local(qwen, tmp_path):
    # real workers: a TP 2 prefill worker and a PP 2 decode worker, each packing int8 at
    # load (`--quantize int8`), the KV and state handed from 2 ranks to 2 stages
    path = qwen["float"]
    specs, want = _reference(path, "int8")
    config = {**CONFIG, "prefill": {"tensor_parallel_size": 2},
              "decode": {"pipeline_parallel_size": 2}}
    cluster = start_cluster(path, write_config(tmp_path / "c.yaml", config), 1, 1,
                            ("--quantize", "int8"))
    try:
        remote = run_remote(cluster.address, specs, concurrency=4)
        counters = assert_clean(cluster)
        for w in list_workers(cluster.address, cluster.secret.bearer):  # split: one child each
            pid = int(w.worker_id.split("-")[-2])
            assert len(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()) == 1
    finally:
        cluster.stop()
    assert {r["id"]: r.get("token_ids", r.get("error")) for r in remote} == want
    assert all(r["prefill_worker"] != r["decode_worker"] for r in remote)
    for wid, c in counters.items():
        assert c["weight_format.w8a16_channel"] == 1.0, wid
