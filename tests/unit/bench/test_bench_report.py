"""`make bench`'s report: JSON, markdown and the pictures each kind of row gets."""

from __future__ import annotations

import json

import pytest

from bench.report import write_report

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


def test_each_kind_of_row_gets_its_pictures(tmp_path):
    rows = {
        "http": [{"label": "grpc", "ttft_p50_ms": 3.0, "ttft_p99_ms": 9.0,
                  "ttft_samples_ms": [1.0, 3.0, 9.0]},
                 {"label": "http", "ttft_p50_ms": 3.1, "ttft_p99_ms": 8.0,
                  "ttft_samples_ms": [2.0, 3.1, 8.0], "ratio": 0.98}],
        "transfer": [{"bytes": 2**20, "gbps": 1.5, "memcpy_gbps": 9.0},
                     {"bytes": 2**24, "gbps": 6.0, "memcpy_gbps": 10.0}],
        "reuse": [{"label": "off", "prefill_tokens_computed": 900, "oracle_tokens": 300},
                  {"label": "session", "prefill_tokens_computed": 320, "oracle_tokens": 300}],
    }
    write_report(tmp_path, rows)
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["http-latency-hist.png", "http-latency.png", "http-ratio.png",
                    "reuse-prefill-vs-oracle.png", "transfer-bandwidth.png"]
    assert all((tmp_path / p).read_bytes().startswith(PNG) for p in pngs)
    assert json.loads((tmp_path / "results.json").read_text()) == rows
    md = (tmp_path / "results.md").read_text()
    assert "| label | ttft_p50_ms | ttft_p99_ms | ratio |" in md  # lists stay out of tables
