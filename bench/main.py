"""`baton bench ...`: runs benchmarks, prints JSON lines, writes results, table and plots."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

from baton.model.progress import progress

BENCHES = ("engine", "reuse", "transfer", "router", "e2e", "handoff", "pp", "tp", "http",
           "soak", "spec", "grammar")


CHECKOUT = Path(__file__).resolve().parents[1]
"""The source checkout: its tests/support holds the harnesses some benchmarks drive."""


def run_bench(args) -> int:
    if (CHECKOUT / "tests" / "support").is_dir() and str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))  # test harnesses are not shipped in the package
    names = BENCHES if args.which == "all" else (args.which,)
    out_dir = Path(args.out) if args.out else None
    all_rows: dict[str, list[dict]] = {}
    failed = []
    for name in progress(names, "benchmarks", "benchmark"):
        mod = importlib.import_module(f"bench.{name}")
        t0 = time.monotonic()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            rows = mod.run(args)
        except Exception as e:  # noqa: BLE001 - one failed benchmark must not hide the others
            print(f"[bench] {name} failed: {e!r}", file=sys.stderr)
            rows = [{"benchmark": name, "error": repr(e)}]
        failed += [name] if any("error" in r for r in rows) else []
        all_rows[name] = rows
        for r in rows:
            r.setdefault("benchmark", name)
            if args.json or out_dir is None:
                print(json.dumps(r), flush=True)
        print(f"[bench] {name} done in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    if out_dir is not None:
        from bench.report import write_report

        write_report(out_dir, all_rows)
        print(f"[bench] results in {out_dir}/", file=sys.stderr)
    if failed:
        print(f"[bench] FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
