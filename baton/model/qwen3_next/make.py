"""Seeded Qwen3-Next checkpoints: Qwen3.5-MoE's maker in Qwen3-Next's published layout
(flat config, per-expert tensors, interleaved DeltaNet projections)."""

from __future__ import annotations

from pathlib import Path

from baton.model.qwen3_5.moe_make import write_checkpoint as write_qwen_moe


def write_checkpoint(out_dir: str | Path, **kw) -> Path:
    return write_qwen_moe(out_dir, family="qwen3_next", **kw)
