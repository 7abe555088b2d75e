"""A model that mixes two recurrent kinds (`tests/support/toy_family/mixed.py`: Mamba2 `M` and
gated DeltaNet `G` layers beside attention and MLP, pattern `MG*-GM*-`): its one state list
holds both kinds' tensors under their own names, and it is served like any family. A
colocated engine's greedy tokens equal plain prefill + one-token decodes, prefix reuse on
equals reuse off, a 1P+1D cluster equals `--local`, and a speculative verify pass equals
plain decode bit for bit on both paths (each kind's `verify_positions` / kernel step)."""

from __future__ import annotations

import pytest
import torch

from baton.client.local import run_local
from baton.client.remote import run_remote
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.model.layers.deltanet import GatedDeltaNet
from baton.model.layers.mamba2 import Mamba2Mixer
from baton.model.loader import load_model
from tests.integration.cluster_helpers import start_cluster, write_config
from tests.integration.test_pipeline_cluster import greedy, tokens
from tests.support.engine_helpers import make_checkpoint, prompt
from tests.support.toy_family import mixed
from tests.unit.engine.speculative.test_speculative import (
    _assert_verify_equals_decode_bit_for_bit,
    _linear_row_by_row,
)

pytestmark = pytest.mark.integration

CONFIG = {"cache": {"num_blocks": 256, "num_state_slots": 16,
                    "mamba_state_config": {"periodic_snapshot_interval": 0,
                                           "additional_snapshot_offsets_from_end": [0],
                                           "decode_end_snapshot": True}},
          "worker": {"max_num_seqs": 8, "max_model_len": 512, "prefill_chunk_size": 16}}
NO_REUSE = {**CONFIG, "cache": {**CONFIG["cache"], "enable_prefix_reuse": False}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixedkinds")
    env = pytest.MonkeyPatch()
    env.setenv("BATON_FAMILY_MODULES", mixed.MODULE)  # every child process registers it too
    try:
        yield {"model": make_checkpoint(root, "mixed", family="toy_mixed", seed=5),
               "root": root}
    finally:
        env.undo()


def specs(tag: str = "m"):
    return [RequestSpec(f"{tag}{i}", prompt_ids=prompt(i, 5 + 13 * i), sampling=greedy(8))
            for i in range(4)]


def local(setup, config, requests):
    return tokens(run_local(build_engine(BatonConfig.from_dict(config), str(setup["model"])),
                            requests, 4))


def test_one_state_list_holds_both_kinds(setup):
    model = load_model(setup["model"])
    cfg = model.config
    assert (cfg.pattern, cfg.state_layers) == ("MG*-GM*-", (0, 1, 4, 5))
    assert [t.name for t in cfg.state_tensors] == ["conv", "ssm", "gdn_conv", "recurrent"]
    kinds = {i: type(b.mixer) for i, b in enumerate(model.blocks()) if i in cfg.state_layers}
    assert kinds == {0: Mamba2Mixer, 1: GatedDeltaNet, 4: GatedDeltaNet, 5: Mamba2Mixer}
    assert [model.blocks()[i].mixer.state_names for i in (0, 1)] == [("conv", "ssm"),
                                                                     mixed.GDN_STATE]
    pools = model.make_pools(8, 16, 2)
    assert {n: tuple(t.shape[:2]) for n, t in pools.state.items()} == {
        n: (4, 2) for n in ("conv", "ssm", "gdn_conv", "recurrent")}


def test_colocated_greedy_tokens_equal_plain_prefill_and_decode(setup):
    model = load_model(setup["model"])
    want = {}
    for s in specs():
        pools = model.make_pools(64, 16, 1)
        table = list(range(64))
        ids = list(s.prompt_ids)
        logits = model.prefill(torch.tensor(ids), 0, table, 0, pools)
        out = []
        for _ in range(8):
            out.append(int(logits.argmax(-1).reshape(-1)[0]))
            logits = model.decode(torch.tensor([out[-1]]), torch.tensor([len(ids)]), [table],
                                  torch.tensor([0]), pools)
            ids.append(out[-1])
        want[s.id] = out
    assert local(setup, NO_REUSE, specs()) == want


def test_prefix_reuse_on_equals_reuse_off(setup):
    """The second turn of each chat restores its first turn's decode-end state (both kinds'
    tensors) instead of recomputing it: the same tokens as without reuse."""
    first = specs("a")
    engine = build_engine(BatonConfig.from_dict(CONFIG), str(setup["model"]))
    got1 = tokens(run_local(engine, first, 4))
    second = [RequestSpec(f"b{i}", prompt_ids=[*s.prompt_ids, *got1[s.id], *prompt(9 + i, 4)],
                          sampling=greedy(8)) for i, s in enumerate(first)]
    results = run_local(engine, second, 4)
    assert all(r["cached_tokens"] > 0 for r in results)
    assert tokens(results) == local(setup, NO_REUSE, second)


def test_a_1p_1d_cluster_equals_local(setup):
    cluster = start_cluster(setup["model"], write_config(setup["root"] / "c.yaml", CONFIG),
                            1, 1)
    try:
        remote = run_remote(cluster.address, specs(), concurrency=4)
    finally:
        cluster.stop()
    assert tokens(remote) == local(setup, NO_REUSE, specs())


def test_verify_pass_equals_plain_decode_on_both_paths(setup, monkeypatch):
    """Speculation's verify pass over both kinds: the fast path's kernel steps, and on the
    reference path Mamba2's own per-position verify and DeltaNet's generic one (an
    attention-free pattern, linears row by row, as test_speculative does)."""
    from baton.model.layers import cpu_kernels, step_kernels
    from baton.model.layers.linear import reference_scope

    if cpu_kernels.gemv() is not None and step_kernels.kernels() is not None:
        _assert_verify_equals_decode_bit_for_bit(load_model(setup["model"]))
    recurrent = load_model(make_checkpoint(setup["root"], "norec", family="toy_mixed",
                                           pattern="MG-GM-", seed=6))
    monkeypatch.setattr(torch.nn.functional, "linear", _linear_row_by_row)
    with reference_scope():
        _assert_verify_equals_decode_bit_for_bit(recurrent)
