"""Seeded Qwen3-Next checkpoints: Qwen3.5-MoE's maker in Qwen3-Next's published layout
(flat config, per-expert tensors, interleaved DeltaNet projections)."""

from __future__ import annotations

from pathlib import Path

from baton.model.qwen3_5.moe_make import per_expert
from baton.model.qwen3_5.moe_make import write_checkpoint as write_qwen_moe
from baton.model.qwen3_next.convert import join_projections


def write_checkpoint(out_dir: str | Path, **kw) -> Path:
    return write_qwen_moe(out_dir, family="qwen3_next", convert=_published, **kw)


def _published(cfg, tensors):
    """Interleaved DeltaNet projections, one tensor per expert."""
    return per_expert(join_projections(cfg, tensors))
