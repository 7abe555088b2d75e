"""`bench engine --peer llamacpp` at equal bits, without the peer: how each GGUF type is made
(and cached), the rows (labels, ratios, the issue's targets), the quality tally, and Baton's
side of the speed rows on a tiny model against a stand-in worker."""

from __future__ import annotations

import math

import pytest
import torch

from bench import engine_peer as ep
from bench import llamacpp_peer as peer
from bench.quality import Tally


def test_gguf_types_are_made_by_the_converter_or_llama_cpps_quantizer():
    assert peer.gguf_recipe("q8_0") == ("convert", "q8_0")
    assert peer.gguf_recipe("f32") == ("convert", "f32")
    assert peer.gguf_recipe("q4_0") == ("quantize", "LLAMA_FTYPE_MOSTLY_Q4_0")
    assert peer.gguf_recipe("q4_k_m") == ("quantize", "LLAMA_FTYPE_MOSTLY_Q4_K_M")
    assert {g for _, g in ep.PAIRS} <= set(peer.GGUF_TYPES)
    with pytest.raises(ValueError, match=r"GGUF type 'q3_k' .*allowed: f32, f16, bf16, q8_0"):
        peer.gguf_recipe("q3_k")


def test_a_quantized_gguf_is_cached_and_a_failed_quantizer_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    ckpt = tmp_path / "m"
    ckpt.mkdir()
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "m-f32.gguf").write_bytes(b"GGUF")  # convert()'s cached output
    (tmp_path / "gguf" / "m-q4_k_m.gguf").write_bytes(b"GGUF")
    # cached: returned as it is, nothing run (the python given does not exist)
    assert peer.gguf(ckpt, "q4_k_m", py=tmp_path / "none") == tmp_path / "gguf" / "m-q4_k_m.gguf"
    assert peer.gguf(ckpt, "f32", py=tmp_path / "none") == tmp_path / "gguf" / "m-f32.gguf"
    fails = tmp_path / "py"
    fails.write_text("#!/bin/sh\necho 'llama_model_quantize: failed to quantize' >&2\nexit 1\n")
    fails.chmod(0o755)
    with pytest.raises(peer.PeerUnavailable,
                       match=r"^llama_model_quantize q4_0 failed on m: .*failed to quantize$"):
        peer.gguf(ckpt, "q4_0", py=fails)
    assert not (tmp_path / "gguf" / "m-q4_0.gguf").exists()


def _runs(wall: float, cpu: float) -> list[dict]:
    return [{"wall_s": wall, "cpu_s": cpu, "wait_s": 0.0}] * 3


def test_speed_rows_carry_both_formats_the_ratio_and_the_issues_target():
    row = ep.bits_row("nemotron_h", "decode-b8", 2, 100, "int4", "q4_0", _runs(1.0, 2.0),
                      _runs(2.0, 3.0), "decode", batch=8, steps=100 // 8)
    assert row["label"] == "nemotron_h-decode-b8-int4-vs-q4_0-t2"
    assert (row["baton_format"], row["llamacpp_format"], row["threads"]) == ("int4", "q4_0", 2)
    assert row["baton_tok_s"] == 100.0 and row["llamacpp_tok_s"] == 50.0
    assert row["ratio"] == 2.0 and row["cpu_ratio"] == 1.5
    assert row["target"] == 1.5 and row["met"] is True
    b1 = ep.bits_row("q", "decode-b1", 1, 10, "int8", "q8_0", _runs(2.0, 2.0), _runs(1.0, 1.0),
                     "decode", batch=1)
    assert (b1["ratio"], b1["target"], b1["met"]) == (0.5, 1.0, False)
    pre = ep.bits_row("q", "prefill", 1, 2048, "int8", "q8_0", _runs(1.0, 1.0),
                      _runs(1.3, 1.3), "prefill")
    assert pre["target"] == 1.2 and pre["met"] is True and pre["baton_ms"] == 1000.0
    b32 = ep.bits_row("q", "decode-b32", 1, 10, "int8", "q8_0", _runs(1.0, 1.0),
                      _runs(1.0, 1.0), "decode", batch=32)
    assert "target" not in b32 and "met" not in b32  # the issue sets none for batch 32


def test_rss_row_is_barons_peak_over_llama_cpps():
    row = ep.rss_row("qwen3_5", "int8", "q8_0", {"peak_rss_kb": 1100 * 1024,
                                                 "weight_bytes": 120_000_000},
                     {"peak_rss_kb": 1000 * 1024, "file_bytes": 130_000_000})
    assert row["label"] == "qwen3_5-rss-int8-vs-q8_0"
    assert (row["baton_peak_rss_mib"], row["llamacpp_peak_rss_mib"]) == (1100.0, 1000.0)
    assert row["rss_ratio"] == 1.1 and row["met"] is True
    assert (row["baton_weight_mb"], row["llamacpp_gguf_mb"]) == (120.0, 130.0)
    over = ep.rss_row("q", "int4", "q4_0", {"peak_rss_kb": 1200, "weight_bytes": 1},
                      {"peak_rss_kb": 1000, "file_bytes": 1})
    assert over["met"] is False


def test_tally_gives_perplexity_kl_from_the_reference_and_top1_agreement():
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.7, 0.1]]))
    other = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.2, 0.7, 0.1]]))
    target = torch.tensor([0, 1])
    same, t = Tally(), Tally()
    same.add(ref, target, ref)
    t.add(other, target, ref)
    m = same.metrics()
    assert m["mean_kl"] == 0.0 and m["top1_agreement"] == 1.0 and m["tokens"] == 2
    assert math.isclose(m["perplexity"], math.exp(-(math.log(0.5) + math.log(0.7)) / 2),
                        rel_tol=1e-6)
    m = t.metrics(total_bytes=4)
    kl_row0 = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)
    assert math.isclose(m["mean_kl"], kl_row0 / 2, rel_tol=1e-5)
    assert m["top1_agreement"] == 0.5
    assert math.isclose(m["bits_per_byte"], -(math.log(0.25) + math.log(0.7)) / math.log(2) / 4,
                        rel_tol=1e-6)
    assert "mean_kl" not in t.metrics(compared=False)


def test_quality_rows_compare_each_pair_kl():
    def m(kl, top1, ppl):
        return {"tokens": 100, "perplexity": ppl, "mean_kl": kl, "top1_agreement": top1}

    metrics = {("baton", "float32"): m(0.0, 1.0, 9.0), ("baton", "int8"): m(0.001, 0.99, 9.01),
               ("baton", "int4"): m(0.03, 0.9, 9.5), ("llamacpp", "f32"): m(1e-7, 1.0, 9.0),
               ("llamacpp", "q8_0"): m(0.002, 0.98, 9.02), ("llamacpp", "q4_0"): m(0.02, 0.92,
                                                                                   9.4)}
    rows = ep.quality_rows("nemotron_h", 4, metrics)
    by = {r["label"]: r for r in rows}
    assert by["nemotron_h-quality-llamacpp-q8_0"]["mean_kl"] == 0.002
    assert by["nemotron_h-quality-baton-int4"]["windows"] == 4
    q8 = by["nemotron_h-quality-int8-vs-q8_0"]
    assert (q8["kl_ratio"], q8["met"], q8["baton_top1"], q8["llamacpp_top1"]) == (
        0.5, True, 0.99, 0.98)
    q4 = by["nemotron_h-quality-int4-vs-q4_0"]
    assert (q4["kl_ratio"], q4["met"]) == (1.5, False)
    assert "nemotron_h-quality-int4-vs-q4_k_m" not in by  # no Q4_K_M measured: no pair row
    assert "nemotron_h-quality-fp8-vs-bf16" not in by
    metrics |= {("baton", "fp8"): m(0.004, 0.97, 9.1), ("baton", "bf16"): m(0.002, 0.99, 9.0)}
    fp8 = {r["label"]: r for r in ep.quality_rows("q", 4, metrics)}["q-quality-fp8-vs-bf16"]
    assert (fp8["peer"], fp8["bf16_format"], fp8["bf16_mean_kl"], fp8["kl_ratio"]) == (
        "baton-bf16", "bf16", 0.002, 2.0)
    assert "met" not in fp8  # the issue sets no target for fp8 against bf16


def test_fp8_rows_name_both_baton_sides():
    row = ep.fp8_row("qwen3_5", "decode-b1", 1, 10, {"fp8": _runs(1.0, 1.0),
                                                     "bf16": _runs(2.0, 2.0)}, "decode", batch=1)
    assert row["label"] == "qwen3_5-decode-b1-fp8-vs-bf16-t1" and row["peer"] == "baton-bf16"
    assert (row["fp8_tok_s"], row["bf16_tok_s"], row["ratio"]) == (10.0, 5.0, 2.0)
    assert not any(k.startswith(("baton_tok", "llamacpp_")) for k in row)


def test_one_engine_holds_every_workload():
    sz = ep.sizes(quick=False)
    cfg = ep._bits_config("int4", sz)
    assert cfg["model"]["quantize"] == "int4"
    assert ep._bits_config("float32", sz)["model"]["quantize"] is None
    assert cfg["worker"]["max_num_seqs"] == 32 and cfg["cache"]["num_state_slots"] == 33
    assert cfg["worker"]["max_model_len"] > sz["prefill"] + 1
    for batch, (plen, steps) in sz["decode"].items():
        assert cfg["cache"]["num_blocks"] >= batch * -(-(plen + steps + 2) // 16)
    assert cfg["cache"]["num_blocks"] >= -(-(sz["prefill"] + 2) // 16)


class _StandIn:
    """A llama.cpp worker's answers without llama.cpp: fixed timings, calls recorded."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def call(self, op: str, **args) -> dict:
        self.calls.append((self.name, op))
        return {"wall_s": 0.5, "cpu_s": 0.5, "wait_s": 0.0}


def test_speed_rows_alternate_each_baton_format_with_its_peers(model_tiny_dir):
    torch.set_num_threads(1)
    sz = ep.sizes(quick=True) | {"prefill": 64, "decode": {1: (16, 4), 8: (16, 4)},
                                 "repeats": 2}
    engines = {f: ep._bits_engine(model_tiny_dir, f, sz)
               for f in dict.fromkeys(f for f, _ in ep.PAIRS)}
    assert engines["int4"].weights.bytes < engines["int8"].weights.bytes
    assert engines["int8a8e"].weights.format.endswith("+int8_activations")
    calls: list = []
    workers = {g: _StandIn(g, calls) for _, g in ep.PAIRS}
    rows = ep._bits_speed("nemotron_h", 256, 1, engines, workers, sz)
    assert [r["label"] for r in rows] == [
        f"nemotron_h-{w}-{f}-vs-{g}-t1" for w in ("prefill", "decode-b1", "decode-b8")
        for f, g in ep.PAIRS]
    assert all(r["baton_tok_s"] > 0 and r["llamacpp_format"] in workers for r in rows)
    # int4's peers take turns after each Baton run, both repeats
    assert calls[:6] == [("q8_0", "prefill")] * 2 + [("q4_0", "prefill"), ("q4_k_m", "prefill")] * 2
    fp8 = ep.fp8_checkpoint("nemotron_h", model_tiny_dir)
    assert ep.fp8_checkpoint("nemotron_h", model_tiny_dir) == fp8  # written once
    halves = {"fp8": ep._bits_engine(fp8, "float32", sz),
              "bf16": ep._bits_engine(model_tiny_dir, "bf16", sz)}
    assert halves["fp8"].weights.format == "fp8"  # ModelOpt FP8, per tensor
    rows = ep._fp8_speed("nemotron_h", 256, 1, halves, sz)
    assert [r["label"] for r in rows] == [f"nemotron_h-{w}-fp8-vs-bf16-t1"
                                          for w in ("prefill", "decode-b1", "decode-b8")]


def test_baton_quality_side_scores_each_format_against_float32(model_tiny_dir):
    torch.set_num_threads(1)
    wins, refs = ep._reference(model_tiny_dir, 32, 2)
    assert len(wins) == 2 and refs[0].shape == (32, 512)
    fp8 = ep.fp8_checkpoint("nemotron_h", model_tiny_dir)
    tallies = ep._baton_tallies(model_tiny_dir, wins, refs, fp8)
    m = {k[1]: t.metrics() for k, t in tallies.items()}
    assert set(m) == {"float32", "int8", "int4", "int8a8e", "int4a8e", "int8a8", "int4a8",
                      "int8e", "bf16", "fp8"}
    assert m["float32"]["mean_kl"] == 0.0 and m["float32"]["top1_agreement"] == 1.0
    for fmt in set(m) - {"float32"}:  # each a little off float32, never wildly
        assert 0 < m[fmt]["mean_kl"] < 0.05 and m[fmt]["top1_agreement"] > 0.8, (fmt, m[fmt])
        assert m[fmt]["tokens"] == 64
    assert m["int8"]["mean_kl"] < m["int4"]["mean_kl"]
    rows = ep.quality_rows("nemotron_h", 2, {k: t.metrics() for k, t in tallies.items()})
    assert [r["label"] for r in rows if "-vs-" in r["label"]] == ["nemotron_h-quality-fp8-vs-bf16"]
