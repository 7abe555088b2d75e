"""`baton bench` (and so `make bench`) fails when a benchmark fails."""

from __future__ import annotations

import sys
import types
from argparse import Namespace

from bench import main


def _args(which: str) -> Namespace:
    return Namespace(which=which, out=None, json=True)


def _fake_bench(monkeypatch, name: str, run) -> None:
    mod = types.ModuleType(f"bench.{name}")
    mod.run = run
    monkeypatch.setitem(sys.modules, f"bench.{name}", mod)


def test_a_failing_benchmark_makes_the_run_fail(monkeypatch, capsys):
    def boom(args):
        raise RuntimeError("no NIXL here")

    _fake_bench(monkeypatch, "fine", lambda args: [{"figure": 1.0}])
    _fake_bench(monkeypatch, "broken", boom)
    monkeypatch.setattr(main, "BENCHES", ("fine", "broken"))
    assert main.run_bench(_args("all")) == 1
    out = capsys.readouterr()
    assert '"benchmark": "fine"' in out.out and "no NIXL here" in out.out
    assert "FAILED: broken" in out.err


def test_an_error_row_counts_as_a_failure(monkeypatch):
    _fake_bench(monkeypatch, "partial", lambda args: [{"figure": 1}, {"error": "timed out"}])
    assert main.run_bench(_args("partial")) == 1


def test_all_benchmarks_passing_exit_zero(monkeypatch):
    _fake_bench(monkeypatch, "fine", lambda args: [{"figure": 1.0}])
    assert main.run_bench(_args("fine")) == 0
