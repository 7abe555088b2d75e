"""MoE models through the whole system: 2 prefill + 2 decode workers, prefix-aware routing,
the decode workers at PP 2, canaries armed. Tokens equal `--local`'s; Stats count the tokens
routed to every expert on every stage.

    nemotron_h  ME*MEE-E   PP [4, 4]: stage 1 `EE-E` holds neither KV nor state pool
    qwen3_next  GG*GGG*G   MoE at layers 1, 3, 7 (decoder_sparse_step 2, mlp_only_layers [5]),
                           the rest dense; interleaved DeltaNet projections, per-expert tensors
"""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.cache import canary
from baton.client.local import run_local
from baton.client.remote import run_remote
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from tests.integration.cluster_helpers import assert_clean, start_cluster, write_config
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = pytest.mark.integration

TOP_K = 2
MODELS = {
    "nemotron_h": (dict(pattern="ME*MEE-E", n_routed_experts=8), (1, 4, 5, 7)),
    "qwen3_next": (dict(family="qwen3_next", pattern="GG*GGG*G", num_experts=8,
                        decoder_sparse_step=2, mlp_only_layers=[5]), (1, 3, 7)),
}
BASE = {
    "cache": {"num_blocks": 512, "num_state_slots": 48,
              "mamba_state_config": {"periodic_snapshot_interval": 32}},
    "router": {"policy": "prefix_aware", "heartbeat_seconds": 0.3, "eject_after_seconds": 20.0,
               "local_prefill_max_tokens": 0},
    "worker": {"max_num_seqs": 8, "max_model_len": 1024, "prefill_chunk_size": 64},
}
DECODE = {"decode": {"pipeline_parallel_size": 2, "pp_layer_partition": [4, 4]}}


@pytest.fixture(scope="module", params=sorted(MODELS))
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("moecluster")
    fields, moe_layers = MODELS[request.param]
    model = make_checkpoint(root, "moe", num_experts_per_tok=TOP_K, seed=3, **fields)
    env = pytest.MonkeyPatch()
    env.setenv(canary.ENV, "1")  # every worker and stage: free blocks and slots hold canaries
    try:
        cluster = start_cluster(model, write_config(root / "c.yaml", {**BASE, **DECODE}), 2, 2)
    finally:
        env.undo()
    yield {"cluster": cluster, "model": model, "moe_layers": moe_layers}
    cluster.stop()


def _stage_processes(model: Path) -> int:
    """Pipeline stages 1.. running on this checkpoint (`--pp-rank` in their command line)."""
    found = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        found += b"--pp-rank" in args and str(model).encode() in args
    return found


def _specs() -> list[RequestSpec]:
    """24 requests over three shared prefixes, so prefix-aware routing has snapshots to follow."""
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    heads = [prompt(900 + h, 70) for h in range(3)]
    return [RequestSpec(f"r{i}", prompt_ids=heads[i % 3] + prompt(i, 5 + 7 * i), sampling=sp)
            for i in range(24)]


def test_moe_cluster_equals_local_and_counts_expert_load(setup):
    assert _stage_processes(setup["model"]) == 2  # one second stage per decode worker
    specs = _specs()
    remote = run_remote(setup["cluster"].address, specs, concurrency=8)
    engine = build_engine(BatonConfig.from_dict(BASE), str(setup["model"]))
    want = {r["id"]: r["token_ids"] for r in run_local(engine, specs, 4)}
    assert {r["id"]: r.get("token_ids", r.get("error")) for r in remote} == want
    assert len({t for ids in want.values() for t in ids}) > 20
    assert len({r["decode_worker"] for r in remote}) == 2
    assert sum(r["cached_tokens"] for r in remote) > 0  # the prefixes were reused
    counters = assert_clean(setup["cluster"])
    routed = {}
    for wid, c in counters.items():
        assert c["canary_bad_blocks"] == 0 and c["canary_bad_slots"] == 0, (wid, c)
        totals = {sum(c[f"expert_tokens_l{layer}_e{e}"] for e in range(8))
                  for layer in setup["moe_layers"]}  # stage 1's come back by call
        assert len(totals) == 1, (wid, totals)  # every MoE layer saw every token
        routed[wid] = totals.pop()
        if wid.startswith("prefill"):  # each computed prompt token went to TOP_K experts
            # (prefix-aware routing may leave one prefill worker without a request: 0 == 0)
            assert routed[wid] == TOP_K * c["prefilled_tokens"], (wid, c)
    assert sum(v for w, v in routed.items() if w.startswith("prefill")) > 0, routed
    assert all(v > 0 for w, v in routed.items() if w.startswith("decode")), routed

