"""Speculative decoding on the decode worker of a 1P+1D cluster: identical to --local with
speculation off, drafts accepted, counts in the gRPC summary, the client's --json and the HTTP answer.
The same with a pipeline-parallel (PP 2) decode worker, whose last stage holds the MTP head,
and with `--local` PP 2 drafting trees.

The prefill worker writes the MTP head's KV of the prompt (an extra attention layer of its KV
pool) and it travels with the target's, whole or layer by layer. The decode worker drafts
from its second step on (the first needs the hidden state of the last prompt position,
which stays on the prefill worker), and the head's entry for that position keeps the
prefill worker's placeholder (its token was not drawn yet).
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from pathlib import Path

import pytest

from baton.client.local import run_local
from baton.client.remote import run_remote
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.config.speculative import SpeculativeConfig
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.proto_gen import baton_pb2
from tests.integration.cluster_helpers import (
    assert_clean,
    list_workers,
    start_cluster,
    write_config,
)
from tests.support.engine_helpers import prompt
from tests.support.speculative_helpers import agreeing_checkpoint

pytestmark = pytest.mark.integration

CONFIG = {
    "cache": {"num_blocks": 512, "num_state_slots": 48},
    "worker": {"max_num_seqs": 8, "max_model_len": 2048},
    "speculative": {"num_draft_tokens": 3, "max_batch": 0},  # drafts at batch 8 too
}


@pytest.mark.parametrize("layerwise", [False, True])
def test_one_prefill_one_decode_worker_speculating_equal_local(tmp_path, layerwise):
    model = agreeing_checkpoint(tmp_path)
    config = {**CONFIG, "transfer": {"layerwise": layerwise, "lease_seconds": 60.0}}
    cluster = start_cluster(model, write_config(tmp_path / "baton.yaml", config), 1, 1)
    try:
        specs = [RequestSpec(f"c{i}", prompt_ids=prompt(i, 1 + 37 * i, vocab=512),
                             sampling=SamplingParams(max_tokens=6 + 5 * i, ignore_eos=True))
                 for i in range(8)]
        remote = run_remote(cluster.address, specs, concurrency=8)
        off = dataclasses.replace(BatonConfig.from_dict(CONFIG),
                                  speculative=SpeculativeConfig(0))
        ref = run_local(build_engine(off, str(model)), specs, 8)
        assert [r["token_ids"] for r in remote] == [r["token_ids"] for r in ref]
        assert all(r["prefill_worker"] != r["decode_worker"] for r in remote)
        assert sum(r.get("accepted_tokens", 0) for r in remote) > 0
        assert all(r["draft_tokens"] >= r["accepted_tokens"] for r in remote)
        # the HTTP answer's baton object carries the counts too
        with urllib.request.urlopen(f"{cluster.http_address}/v1/models", timeout=10) as r:
            name = json.loads(r.read())["data"][0]["id"]
        body = {"model": name, "prompt": specs[3].prompt_ids, "max_tokens": 21,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(f"{cluster.http_address}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["token_ids"] == ref[3]["token_ids"]
        baton = answer["baton"]
        assert baton["draft_tokens"] >= baton["accepted_tokens"] > 0
        assert_clean(cluster)
    finally:
        cluster.stop()


PP_SPLIT = [6, 2]
"""Of `M*M-M*M-`: the last stage (`M-`) is attention-free, so its KV pool holds the MTP
head's layer alone."""


@pytest.fixture(scope="module")
def pp_setup(tmp_path_factory):
    """One 1P + (PP 2 decode) cluster for the module, speculating at K=3."""
    root = tmp_path_factory.mktemp("spec_pp")
    model = agreeing_checkpoint(root)
    config = {**CONFIG, "transfer": {"lease_seconds": 60.0},
              "decode": {"pipeline_parallel_size": 2, "pp_layer_partition": PP_SPLIT}}
    cluster = start_cluster(model, write_config(root / "baton.yaml", config), 1, 1)
    try:
        yield model, cluster
    finally:
        cluster.stop()


def _specs(tag: str) -> list[RequestSpec]:
    return [RequestSpec(f"{tag}{i}", prompt_ids=prompt(i, 1 + 29 * i, vocab=512),
                        sampling=SamplingParams(max_tokens=5 + 4 * i, ignore_eos=True))
            for i in range(8)]


def test_pp2_decode_worker_and_local_pp2_speculating_equal_local(pp_setup):
    model, cluster = pp_setup
    specs = _specs("p")
    remote = run_remote(cluster.address, specs, concurrency=8)
    off = dataclasses.replace(BatonConfig.from_dict(CONFIG), speculative=SpeculativeConfig(0))
    ref = run_local(build_engine(off, str(model)), specs, 8)
    assert [r["token_ids"] for r in remote] == [r["token_ids"] for r in ref]
    assert all(r["prefill_worker"] != r["decode_worker"] for r in remote)
    assert sum(r.get("accepted_tokens", 0) for r in remote) > 0
    assert all(r["draft_tokens"] >= r["accepted_tokens"] for r in remote)
    decode = [w for w in list_workers(cluster.address, cluster.secret.bearer)
              if w.role == baton_pb2.WORKER_ROLE_DECODE]
    # the decode worker is PP 2: its stage 1 is its one child process
    pid = int(decode[0].worker_id.split("-")[-2])
    assert len(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()) == 1
    # --local PP 2 drafting trees (the cluster drafted chains; the kept nodes' KV moves are
    # mirrored cache operations)
    tree = {**CONFIG["speculative"], "tree": {"top_k": [2, 2, 1], "max_total_draft_tokens": 5}}
    cfg = BatonConfig.from_dict({**CONFIG, "speculative": tree, "worker": {
        **CONFIG["worker"], "pipeline_parallel_size": 2, "pp_layer_partition": PP_SPLIT}})
    eng = build_engine(cfg, str(model))
    try:
        local_pp = run_local(eng, specs, 8)
        assert [r["token_ids"] for r in local_pp] == [r["token_ids"] for r in ref]
        assert sum(r["accepted_tokens"] for r in local_pp) > 0
        eng.cache.check_integrity()
    finally:
        eng.model.close()
    assert_clean(cluster)
