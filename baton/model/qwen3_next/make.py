"""Seeded Qwen3-Next checkpoints: Qwen3.5-MoE's maker in Qwen3-Next's published layout
(flat config, per-expert tensors, interleaved DeltaNet projections)."""

from __future__ import annotations

from pathlib import Path

from baton.model.qwen3_5.moe_make import Layout, per_expert
from baton.model.qwen3_5.moe_make import write_checkpoint as write_qwen_moe
from baton.model.qwen3_next.convert import join_projections
from baton.model.tool_templates import HERMES_TEMPLATE


def write_checkpoint(out_dir: str | Path, **kw) -> Path:
    return write_qwen_moe(out_dir, layout=LAYOUT, **kw)


def _published(cfg, tensors):
    """Interleaved DeltaNet projections, one tensor per expert."""
    return per_expert(join_projections(cfg, tensors))


LAYOUT = Layout(model_type="qwen3_next", architecture="Qwen3NextForCausalLM",
                fields=dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
                chat_template=HERMES_TEMPLATE, multimodal=False, convert=_published)
"""Qwen3-Next's published layout: flat `qwen3_next`, experts one tensor each
(`mlp.experts.{e}.gate_proj.weight` ...), DeltaNet projections interleaved (`in_proj_qkvz`,
`in_proj_ba`), the Hermes tool-call template."""
