"""`bench/` stands on its own: no benchmark reaches into `tests/`, and its benchmarks are
listed once (`bench.BENCHES`), which `baton bench`'s choices read."""

from __future__ import annotations

import ast
from pathlib import Path

import bench
from baton.cli import build_parser

BENCH = Path(bench.__file__).resolve().parent


def test_no_bench_module_imports_tests():
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(BENCH)}:{node.lineno} {n}" for n in names
                      if n == "tests" or n.startswith("tests.")]
    assert not found, found


def test_every_listed_benchmark_is_a_module_and_the_cli_offers_exactly_them():
    assert all((BENCH / f"{name}.py").is_file() for name in bench.BENCHES)
    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "cmd")
    which = next(a for a in sub.choices["bench"]._actions if a.dest == "which")
    assert list(which.choices) == [*bench.BENCHES, "all"]
