"""Qwen3-Next: Qwen3.5's gated DeltaNet and gated attention with interleaved DeltaNet
projections (rearranged at load, `convert`) and MoE feed-forwards on a sparse-step grid."""
