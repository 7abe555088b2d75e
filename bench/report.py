"""Writes benchmark rows as JSON, one markdown table per benchmark, and PNG plots
(`bench/plots.py`)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.plots import draw


def write_report(out_dir: Path, all_rows: dict[str, list[dict]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(all_rows, indent=2))
    lines = ["# Baton benchmarks", ""]
    for name, rows in all_rows.items():
        lines += [f"## {name}", "", *_table(rows), ""]
        draw(out_dir / name, name, rows)  # {name}-{kind}.png, see bench/plots.py
    (out_dir / "results.md").write_text("\n".join(lines))


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(no rows)"]
    keys = [k for k in rows[0] if not isinstance(rows[0][k], (list, dict))]
    for r in rows[1:]:
        keys += [k for k in r if k not in keys and not isinstance(r[k], (list, dict))]
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(k, "")) for k in keys) + " |")
    return out


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)

