"""Writes benchmark rows as JSON, one markdown table per benchmark, and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out_dir: Path, all_rows: dict[str, list[dict]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(all_rows, indent=2))
    lines = ["# Baton benchmarks", ""]
    for name, rows in all_rows.items():
        lines += [f"## {name}", "", *_table(rows), ""]
        _plot(out_dir / f"{name}.png", name, rows)
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


def _plot(path: Path, name: str, rows: list[dict]) -> None:
    """Bar chart of each row's `ratio` (or first numeric figure) against its label."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    pts = []
    for r in rows:
        val = r.get("ratio", r.get("ratio_to_memcpy", r.get("ratio_to_baseline")))
        if isinstance(val, (int, float)):
            pts.append((str(r.get("label", r.get("bytes", len(pts)))), float(val)))
    if not pts:
        return
    fig, ax = plt.subplots(figsize=(max(4, len(pts) * 0.8), 3))
    ax.bar([p[0] for p in pts], [p[1] for p in pts])
    ax.set_title(f"{name}: ratio to baseline")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
