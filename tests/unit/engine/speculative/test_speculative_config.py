"""MTP heads as published (load, write, refuse) and the `speculative` config's bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.config import BatonConfig
from baton.errors import ConfigError
from baton.model.loader import load_model
from baton.model.make_model import write_checkpoint
from tests.support.engine_helpers import engine_for

MTP_NAMES = [
    "mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
    "mtp.layers.0.mixer.k_proj.weight", "mtp.layers.0.mixer.o_proj.weight",
    "mtp.layers.0.mixer.q_proj.weight", "mtp.layers.0.mixer.v_proj.weight",
    "mtp.layers.0.norm.weight", "mtp.layers.1.final_layernorm.weight",
    "mtp.layers.1.mixer.down_proj.weight", "mtp.layers.1.mixer.up_proj.weight",
    "mtp.layers.1.norm.weight",
]


def test_make_model_writes_the_published_names_and_loader_reads_them(tmp_path):
    ck = write_checkpoint(tmp_path / "m", seed=0, mtp_layers=1)
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["mtp_hybrid_override_pattern"] == "*-"
    t = load_file(str(ck / "model.safetensors"))
    assert sorted(k for k in t if k.startswith("mtp.")) == MTP_NAMES
    assert t["mtp.layers.0.eh_proj.weight"].shape == (128, 256)
    model = load_model(ck)
    assert torch.equal(model.mtp.layers[0].eh_proj.weight, t["mtp.layers.0.eh_proj.weight"])
    assert model.mtp.attention_layers == (8,)
    # the target's weights are those of the same seed without a head
    plain = load_file(str(write_checkpoint(tmp_path / "p", seed=0) / "model.safetensors"))
    assert all(torch.equal(plain[k], t[k]) for k in plain)


def test_mtp_block_types_list_is_read(tmp_path):
    ck = write_checkpoint(tmp_path / "m", seed=0, mtp_layers=1)
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["mtp_hybrid_override_pattern"]
    cfg["mtp_layers_block_type"] = ["full_attention", "mlp"]
    (ck / "config.json").write_text(json.dumps(cfg))
    assert load_model(ck).mtp.spec.pattern == "*-"


def test_declared_head_without_tensors_cannot_speculate(tmp_path):
    ck = write_checkpoint(tmp_path / "m", seed=0, mtp_layers=1)
    t = load_file(str(ck / "model.safetensors"))
    save_file({k: v for k, v in t.items() if not k.startswith("mtp.")},
              str(ck / "model.safetensors"), metadata={"format": "pt"})
    assert load_model(ck).mtp is None  # loads, without a head
    with pytest.raises(ConfigError, match=r"^speculative.num_draft_tokens=2 needs an MTP head"):
        engine_for(ck, speculative={"num_draft_tokens": 2})


def test_half_a_head_is_refused(tmp_path):
    ck = write_checkpoint(tmp_path / "m", seed=0, mtp_layers=1)
    t = load_file(str(ck / "model.safetensors"))
    del t["mtp.layers.1.final_layernorm.weight"]
    save_file(t, str(ck / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lacks tensor.*final_layernorm"):
        load_model(ck)


@pytest.mark.parametrize("k", [-1, 9, True, "3"])
def test_draft_tokens_out_of_range(k):
    with pytest.raises(ConfigError) as e:
        BatonConfig.from_dict({"speculative": {"num_draft_tokens": k}})
    assert "speculative.num_draft_tokens" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("spec, message", [
    ({"num_draft_tokens": 2, "tree": {"top_k": [2, 2, 1]}},
     "speculative.tree.top_k has 3 depths but speculative.num_draft_tokens=2: they must be "
     "equal (the tree's depth)"),
    ({"num_draft_tokens": 2, "tree": {"top_k": [2, 9]}},
     "speculative.tree.top_k entries must be in 1..8, got [2, 9]"),
    ({"num_draft_tokens": 0, "tree": {"top_k": [2]}},
     "speculative.tree needs speculative.num_draft_tokens > 0 (the tree's depth); got 0"),
    ({"num_draft_tokens": 3, "tree": {"top_k": [8, 8, 8]}},
     "speculative.tree.top_k [8, 8, 8] allows 584 nodes, more than 64; set "
     "max_total_draft_tokens to at most 64"),
    ({"num_draft_tokens": 1, "tree": {"top_k": [2], "max_total_draft_tokens": 65}},
     "speculative.tree.max_total_draft_tokens must be in 0..64 (0 = what top_k allows), "
     "got 65"),
])
def test_bad_trees_are_refused_in_one_line(spec, message):
    with pytest.raises(ConfigError) as e:
        BatonConfig.from_dict({"speculative": spec})
    assert str(e.value) == message


def test_tree_sizes_and_a_tree_larger_than_the_state_pool(tmp_path):
    """A tree keeps one state slot per node and request for the verify pass; one the pool
    cannot hold is refused naming the numbers."""
    from baton.config.speculative import TreeConfig

    assert TreeConfig((3, 2, 1)).max_nodes == 3 + 6 + 6
    assert TreeConfig((3, 2, 1), 8).max_nodes == 8
    ck = write_checkpoint(tmp_path / "m", seed=0, mtp_layers=1)
    tree = {"top_k": [2, 2], "max_total_draft_tokens": 6}
    eng = engine_for(ck, worker={"max_num_seqs": 8}, cache={"num_state_slots": 64},
                     speculative={"num_draft_tokens": 2, "tree": tree})
    assert eng.cache.stats().slots_speculative == 48
    assert eng.spec.scratch.rows_per_request == 6
    with pytest.raises(ConfigError) as e:
        engine_for(ck, worker={"max_num_seqs": 16}, cache={"num_state_slots": 64},
                   speculative={"num_draft_tokens": 2, "tree": tree})
    assert str(e.value) == (
        "speculative.tree (6 nodes) needs 112 state slots (worker.max_num_seqs=16 x (1 live + "
        "6 per node)) but cache.num_state_slots=64; raise num_state_slots to at least 112 "
        "(more for snapshots) or lower max_total_draft_tokens or max_num_seqs")


def test_tree_acceptance_follows_the_targets_argmax():
    from baton.engine.speculative.tree import accept_greedy, depths, path

    # root -> a(1) b(2); a -> c(3) d(4); b -> e(5); d -> f(6)
    parents, tokens = [0, 0, 1, 1, 2, 4], [10, 11, 12, 13, 14, 15]
    assert depths(parents) == [0, 1, 1, 2, 2, 2, 3]
    assert path(parents, 6) == [0, 1, 4, 6]
    # target argmax per row: the root's is 10 (a), a's 13 (d), d's 15 (f), f's 99
    target = [10, 13, 0, 0, 15, 0, 99]
    assert accept_greedy(parents, tokens, target) == [0, 1, 4, 6]
    assert accept_greedy(parents, tokens, [11, 0, 14, 0, 0, 7, 0]) == [0, 2, 5]
    assert accept_greedy(parents, tokens, [42] * 7) == [0]


def test_generate_json_reports_drafts(tmp_path, capsys):
    from baton.cli import main

    ck = write_checkpoint(tmp_path / "m", seed=0, mtp_layers=1)
    argv = ["--log-level", "WARNING", "generate", "--local", "--model", str(ck),
            "--prompt-ids", "5,6,7,8", "--max-tokens", "9", "--json"]
    assert main(argv) == 0
    off = json.loads(capsys.readouterr().out)
    assert main([*argv, "--speculative-tokens", "3"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["token_ids"] == off["token_ids"] and "draft_tokens" not in off
    # 8 decode steps at most, each drafting min(3, tokens left - 1)
    assert on["draft_tokens"] >= 3 and 0 <= on["accepted_tokens"] <= on["draft_tokens"]


def test_state_slots_per_request_are_sized_and_reported(tmp_path):
    ck = write_checkpoint(tmp_path / "m", seed=0, mtp_layers=1)
    eng = engine_for(ck, worker={"max_num_seqs": 16}, cache={"num_state_slots": 64},
                     speculative={"num_draft_tokens": 3})
    s = eng.cache.stats()
    assert (s.slots_speculative, s.slots_total, s.snapshot_budget) == (48, 16, 0)
    assert eng.spec.scratch.first_slot == 16
    eng.cache.check_integrity()
    with pytest.raises(ConfigError) as e:
        engine_for(ck, worker={"max_num_seqs": 16}, cache={"num_state_slots": 64},
                   speculative={"num_draft_tokens": 4})
    assert str(e.value).startswith(
        "speculative.num_draft_tokens=4 needs 80 state slots (worker.max_num_seqs=16 x "
        "(1 live + 4 per position)) but cache.num_state_slots=64")
    off = engine_for(ck, worker={"max_num_seqs": 16}, cache={"num_state_slots": 64})
    assert off.cache.stats().slots_speculative == 0 and off.cache.stats().slots_total == 64


def test_prometheus_counts_drafts_and_accepted_lengths(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from baton.engine.request import Request
    from baton.worker.metrics import _EngineCollector
    from tests.support.engine_helpers import greedy, run_all
    from tests.support.speculative_helpers import agreeing_checkpoint

    eng = engine_for(agreeing_checkpoint(tmp_path), worker={"max_num_seqs": 4},
                     speculative={"num_draft_tokens": 2})
    reqs = [Request(f"r{i}", [5 + i, 9, 40 + i], greedy(12)) for i in range(3)]
    outs = run_all(eng, reqs)["outputs"]
    spec = eng.spec
    assert sum(o.draft_tokens for o in outs.values()) == spec.draft_tokens > 0
    assert sum(o.accepted_tokens for o in outs.values()) == spec.accepted_tokens > 0
    assert sum(a * n for a, n in enumerate(spec.accepted_hist)) == spec.accepted_tokens

    class Loop:
        engine = eng

        def call(self, fn):
            return fn()

    reg = CollectorRegistry()
    reg.register(_EngineCollector("decode", Loop()))
    text = generate_latest(reg).decode()
    steps = sum(spec.accepted_hist)
    assert f'baton_spec_draft_tokens_total{{role="decode"}} {float(spec.draft_tokens)}' in text
    assert f'baton_spec_accepted_tokens_total{{role="decode"}} {float(spec.accepted_tokens)}' \
        in text
    assert f'baton_spec_accepted_length_bucket{{le="+Inf",role="decode"}} {float(steps)}' in text
    assert f'baton_spec_accepted_length_bucket{{le="0.0",role="decode"}} ' \
        f'{float(spec.accepted_hist[0])}' in text


def test_draft_kv_is_a_layer_of_the_kv_pool_and_written_for_handoffs(tmp_path):
    """The head's KV is an extra attention layer of the target's pool (so the transfer
    layout, prefix blocks and snapshots carry it); a prefill-only request writes it too."""
    from baton.engine.request import Request
    from tests.support.engine_helpers import greedy
    from transfer.layout import StageLayout

    ck = write_checkpoint(tmp_path / "m", seed=0, mtp_layers=1)
    eng = engine_for(ck, worker={"max_num_seqs": 4}, speculative={"num_draft_tokens": 2})
    assert eng.pools.spec.attn_layers == (1, 5, 8)
    assert StageLayout.from_pools(eng.pools).kv.layers == (1, 5, 8)
    plain = engine_for(ck, worker={"max_num_seqs": 4})
    assert plain.pools.spec.attn_layers == (1, 5)
    ids = list(range(3, 40))
    kv = {}
    for name, prefill_only in (("p", True), ("c", False)):
        e = eng if prefill_only else engine_for(ck, worker={"max_num_seqs": 4},
                                                speculative={"num_draft_tokens": 2})
        r = Request(name, ids, greedy(4), prefill_only=prefill_only)
        e.add_request(r)
        e.step()
        table = e.cache.block_table(name)
        kv[name] = torch.cat([e.pools.kv[2, b] for b in table], dim=1)[:, : len(ids) - 1]
    assert kv["p"].abs().sum() > 0
    assert torch.equal(kv["p"], kv["c"])  # entries 0..L-2 (L-1 waits for the first token)


def test_moe_head_loads_from_per_expert_tensors(tmp_path):
    """A MoE `*E` head is written in the published per-expert layout (`mtp.layers.1.mixer.
    experts.{i}.{up,down}_proj.weight`, as Nemotron 3 Super ships it) and loads into the
    stacked experts."""
    ck = write_checkpoint(tmp_path / "m", seed=0, pattern="M*MEM*ME", mtp_layers=1)
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["mtp_hybrid_override_pattern"] == "*E"
    t = load_file(str(ck / "model.safetensors"))
    n = cfg["n_routed_experts"]
    for p in ("up_proj", "down_proj"):
        assert f"mtp.layers.1.mixer.experts.{p}" not in t
        assert all(f"mtp.layers.1.mixer.experts.{e}.{p}.weight" in t for e in range(n))
    head = load_model(ck).mtp
    assert head.spec.pattern == "*E"
    for p in ("up_proj", "down_proj"):
        want = torch.stack([t[f"mtp.layers.1.mixer.experts.{e}.{p}.weight"] for e in range(n)])
        assert torch.equal(getattr(head.layers[1].mixer.experts, p), want)


def test_compute_bound_batches_decode_without_drafts(tmp_path):
    """`speculative.max_batch`: a step with more decoding requests drafts nothing (plain
    decode through the verify path, same tokens); a smaller batch drafts again."""
    from baton.engine.request import Request
    from tests.support.engine_helpers import greedy, prompt, run_all
    from tests.support.speculative_helpers import agreeing_checkpoint

    ck = agreeing_checkpoint(tmp_path)

    def reqs(n):
        return [Request(f"q{i}", prompt(i, 5 + i, vocab=512), greedy(12)) for i in range(n)]

    off = run_all(engine_for(ck, worker={"max_num_seqs": 4}), reqs(3))["tokens"]
    eng = engine_for(ck, worker={"max_num_seqs": 4},
                     speculative={"num_draft_tokens": 3, "max_batch": 2})
    assert run_all(eng, reqs(3))["tokens"] == off
    assert eng.spec.draft_tokens == 0  # three decoded together all along
    assert run_all(eng, reqs(1))["tokens"] == {"q0": off["q0"]}
    assert eng.spec.accepted_tokens > 0
    with pytest.raises(ConfigError, match=r"^speculative.max_batch must be an integer >= 0"):
        BatonConfig.from_dict({"speculative": {"num_draft_tokens": 1, "max_batch": -1}})


def test_verify_pass_keeps_to_the_packed_kernels_row_count():
    """At most MAX_PACKED_ROWS verify rows while plain decode of the batch would have at
    most that many (one kernel, one rounding): the largest draft counts give way first."""
    from types import SimpleNamespace

    from baton.engine.speculative.decoder import _fit_rows
    from baton.model.layers.linear import MAX_PACKED_ROWS

    assert MAX_PACKED_ROWS == 64
    reqs = [SimpleNamespace(id=f"r{i}") for i in range(32)]
    ks = {r.id: 3 for r in reqs}
    _fit_rows(reqs, ks)
    assert sum(ks.values()) + 32 == 64 and set(ks.values()) == {1}
    ks = {r.id: (5 if i < 4 else 0) for i, r in enumerate(reqs)}
    _fit_rows(reqs, ks)  # 32 + 20 rows: nothing to cut
    assert sum(ks.values()) == 20
    many = [SimpleNamespace(id=f"m{i}") for i in range(65)]
    ks = {r.id: 2 for r in many}
    _fit_rows(many, ks)  # plain decode of 65 rows is on MKL too: left alone
    assert set(ks.values()) == {2}


@pytest.mark.parametrize("weights, path, drafts", [
    ("float32", "fast", 3), ("float32", "reference", 3),
    ("bfloat16", "fast", 3), ("bfloat16", "reference", 1),
])
def test_verify_rows_capped_only_for_half_weights_off_the_fast_path(
        tmp_path, monkeypatch, cpu_kernels_built, weights, path, drafts):
    """32 requests at K=3: every request drafts K (a verify pass of 128 rows) where the
    kernels take any row count (the fast path) or the weights are float32; half weights on
    the reference path keep to MAX_PACKED_ROWS rows, one draft each. Greedy tokens equal
    speculation off on the same path either way."""
    from baton.engine.request import Request
    from baton.engine.speculative import decoder
    from baton.model.layers.linear import set_decode_path
    from tests.support.engine_helpers import greedy, prompt, run_all
    from tests.support.speculative_helpers import agreeing_checkpoint

    if path == "fast" and None in cpu_kernels_built:
        pytest.skip("Baton's CPU kernels are not built on this machine")
    seen = []
    draft = decoder.SpeculativeDecoder._draft
    monkeypatch.setattr(decoder.SpeculativeDecoder, "_draft",
                        lambda self, e, r, ks: (seen.append(dict(ks)), draft(self, e, r, ks))[1])
    ck = agreeing_checkpoint(tmp_path)

    def tokens(**spec):
        eng = engine_for(ck, model={"weight_dtype": weights}, speculative=spec,
                         worker={"max_num_seqs": 32, "max_batch_tokens": 1024},
                         cache={"num_blocks": 1024, "num_state_slots": 160})
        reqs = [Request(f"r{i}", prompt(i, 4 + i % 5), greedy(10)) for i in range(32)]
        return eng, run_all(eng, reqs)["tokens"]

    old = set_decode_path(path)
    try:
        off = tokens()[1]
        eng, got = tokens(num_draft_tokens=3)
    finally:
        set_decode_path(old)
    assert eng.spec.half_weights == (weights != "float32")
    full = [ks for ks in seen if len(ks) == 32]
    assert full and set(full[0].values()) == {drafts}
    assert got == off
    assert eng.spec.accepted_tokens > 0
