"""A quantized checkpoint (NemotronH MoE in ModelOpt's MIXED_PRECISION layout: routed experts
NVFP4, the other projections FP8, attention bf16, as Nemotron 3 Super ships) through a 1P+1D
cluster and a TP 2 engine gives `--local`'s greedy tokens; the workers report its format. The
float checkpoint served with `--quantize int8` / `int4` (weights packed in memory, read as
stored by the CPU kernels) through 1P+1D gives `--local --quantize`'s tokens."""

from __future__ import annotations

import pytest

from baton.client.remote import run_remote
from baton.client.requests import RequestSpec
from baton.engine.request import Request
from baton.model.loader import load_model
from bench import quant_layouts
from tests.integration.cluster_helpers import assert_clean, start_cluster, write_config
from tests.integration.test_tp_engine import MARGIN, greedy_margins
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

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


def local_tokens(model, specs, quantize=None, **worker):
    eng = engine_for(model, cache=CONFIG["cache"], worker={**CONFIG["worker"], **worker},
                     model={"quantize": quantize})
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
    assert local_tokens(model, kept, tensor_parallel_size=2) == local_tokens(model, kept)
