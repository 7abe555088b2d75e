"""PNG pictures of benchmark rows, chosen by what the rows hold (not by benchmark name):

    rows with ...                        picture
    `*_samples_ms` lists                 latency histograms, one series per label
    `*_p50_ms` and `*_p99_ms`            p50 / p99 bars per label (TTFT, ITL)
    `bytes` and `gbps`                   GB/s against transfer size (log x), memcpy beside it
    `prefill_tokens_computed`, `oracle_tokens`   computed vs oracle prefill tokens per policy
    `ratio` (anything else)              ratio to the baseline per label

`draw(path_stem, name, rows)` writes every picture that applies and returns the files.
"""

from __future__ import annotations

import re
from pathlib import Path


def draw(stem: Path, name: str, rows: list[dict]) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    for kind, fn in PICTURES:
        fig = fn(plt, name, rows)
        if fig is not None:
            path = stem.with_name(f"{stem.name}-{kind}.png")
            fig.tight_layout()
            fig.savefig(path)
            plt.close(fig)
            out.append(path)
    return out


def _label(r: dict, i: int) -> str:
    return str(r.get("label", r.get("bytes", i)))


def _histograms(plt, name, rows):
    keys = sorted({k for r in rows for k, v in r.items()
                   if k.endswith("_samples_ms") and isinstance(v, list) and v})
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for i, r in enumerate(rows):
            if r.get(key):
                ax.hist(r[key], bins=30, alpha=0.55, label=_label(r, i))
        ax.set_title(f"{name}: {key.removesuffix('_samples_ms')} (ms)")
        ax.set_xlabel("ms")
        ax.set_ylabel("requests")
        ax.legend()
    return fig


def _percentiles(plt, name, rows):
    metrics = sorted({m.group(1) for r in rows for k in r
                      if (m := re.fullmatch(r"(\w+?)_p50_ms", k)) and f"{m.group(1)}_p99_ms" in r})
    if not metrics:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.2), squeeze=False)
    for ax, m in zip(axes[0], metrics, strict=True):
        labels = [_label(r, i) for i, r in enumerate(rows) if f"{m}_p50_ms" in r]
        width = 0.4
        for j, q in enumerate(("p50", "p99")):
            vals = [r[f"{m}_{q}_ms"] for r in rows if f"{m}_p50_ms" in r]
            ax.bar([x + j * width for x in range(len(vals))], vals, width, label=q)
        ax.set_xticks([x + width / 2 for x in range(len(labels))], labels, rotation=30)
        ax.set_title(f"{name}: {m} (ms)")
        ax.legend()
    return fig


def _bandwidth(plt, name, rows):
    pts = sorted((r["bytes"], r["gbps"], r.get("memcpy_gbps")) for r in rows
                 if "bytes" in r and "gbps" in r)
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="transfer")
    if all(p[2] is not None for p in pts):
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "s--", label="memcpy")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per transfer")
    ax.set_ylabel("GB/s")
    ax.set_title(f"{name}: bandwidth vs size")
    ax.legend()
    return fig


def _prefill_vs_oracle(plt, name, rows):
    pts = [(_label(r, i), r["prefill_tokens_computed"], r["oracle_tokens"])
           for i, r in enumerate(rows) if "prefill_tokens_computed" in r and "oracle_tokens" in r]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(max(4, len(pts) * 1.1), 3.2))
    xs = range(len(pts))
    ax.bar([x - 0.2 for x in xs], [p[1] for p in pts], 0.4, label="computed")
    ax.bar([x + 0.2 for x in xs], [p[2] for p in pts], 0.4, label="oracle")
    ax.set_xticks(list(xs), [p[0] for p in pts], rotation=30)
    ax.set_ylabel("prefill tokens")
    ax.set_title(f"{name}: prefill tokens vs oracle per policy")
    ax.legend()
    return fig


def _ratios(plt, name, rows):
    pts = []
    for i, r in enumerate(rows):
        val = r.get("ratio", r.get("ratio_to_memcpy", r.get("ratio_to_baseline")))
        if isinstance(val, (int, float)):
            pts.append((_label(r, i), float(val)))
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(max(4, len(pts) * 0.8), 3))
    ax.bar([p[0] for p in pts], [p[1] for p in pts])
    ax.set_title(f"{name}: ratio to baseline")
    ax.tick_params(axis="x", rotation=45)
    return fig


PICTURES = (("latency-hist", _histograms), ("latency", _percentiles),
            ("bandwidth", _bandwidth), ("prefill-vs-oracle", _prefill_vs_oracle),
            ("ratio", _ratios))
