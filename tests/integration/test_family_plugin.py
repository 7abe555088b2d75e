"""A family that exists only under tests/support/ (`toy_family`: NemotronH's attention and MLP
blocks under model_type `toy_dense`) registers with one entry and is served like a built-in
one: it loads through `--model`, `generate --local` serves it, and so does a 1P+1D cluster,
token for token equal to the same weights loaded as NemotronH. Nothing under baton/ names it:
worker processes import it through BATON_FAMILY_MODULES."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from baton.client.local import run_local
from baton.client.remote import run_remote
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.model import family
from baton.model.config import load_config
from baton.model.loader import load_model
from tests.integration.cluster_helpers import start_cluster, write_config
from tests.integration.test_pipeline_cluster import greedy, tokens
from tests.support.engine_helpers import make_checkpoint, prompt
from tests.support.toy_family import family as toy

pytestmark = pytest.mark.integration

CONFIG = {"cache": {"num_blocks": 256, "num_state_slots": 8},
          "worker": {"max_num_seqs": 8, "max_model_len": 512}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("toyfamily")
    env = pytest.MonkeyPatch()
    env.setenv("BATON_FAMILY_MODULES", toy.MODULE)  # every child process registers it too
    try:
        yield {"toy": make_checkpoint(root, "toy", family="toy_dense", seed=3),
               "ref": make_checkpoint(root, "ref", family="nemotron_h", pattern="*-*-",
                                      seed=3),
               "root": root}
    finally:
        env.undo()


def specs():
    return [RequestSpec(f"t{i}", prompt_ids=prompt(i, 5 + 11 * i), sampling=greedy(6))
            for i in range(4)]


def reference(models):
    engine = build_engine(BatonConfig.from_dict(CONFIG), str(models["ref"]))
    return tokens(run_local(engine, specs(), 4))


def test_one_entry_registers_it_and_it_loads_as_its_own_family(models):
    assert family.for_model_type("toy_dense") is toy.SPEC
    assert "toy_dense" in family.names()
    cfg = load_config(models["toy"])
    assert (type(cfg).__name__, cfg.family, cfg.pattern) == ("ToyConfig", "toy_dense", "*-*-")
    model, ref = load_model(models["toy"]), load_model(models["ref"])
    assert type(model).__name__ == "ToyModel"
    ids = torch.tensor(prompt(1, 9))
    pools, ref_pools = model.make_pools(8, 16, 0), ref.make_pools(8, 16, 0)
    assert torch.equal(model.prefill(ids, 0, [0], 0, pools),
                       ref.prefill(ids, 0, [0], 0, ref_pools))


def test_generate_local_serves_it(models):
    path = models["root"] / "requests.jsonl"
    path.write_text("".join(json.dumps({"id": s.id, "prompt_ids": s.prompt_ids,
                                        "max_tokens": 6, "ignore_eos": True}) + "\n"
                            for s in specs()))
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli", "generate", "--local", "--model",
         str(models["toy"]), "--requests", str(path), "--json"],
        env={**os.environ, "BATON_FAMILY_MODULES": toy.MODULE}, capture_output=True,
        text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.stdout.splitlines())}
    assert got == reference(models)


def test_a_1p_1d_cluster_serves_it(models):
    cluster = start_cluster(models["toy"], write_config(models["root"] / "c.yaml", CONFIG), 1, 1)
    try:
        remote = run_remote(cluster.address, specs(), concurrency=4)
    finally:
        cluster.stop()
    assert tokens(remote) == reference(models)
