"""The raw memory of one worker stage: paged KV blocks and Mamba state slots.

Allocated once at start; the cache manager owns the bookkeeping, the model reads
and writes the tensors, the transfer layer registers their addresses.

    KV pool  kv[attn_layer, block, kv, token, kv_head, head_dim]      (kv: 0 = K, 1 = V)
             |<------------- block_stride = 2*tpb*kvh*hd*itemsize ------------->|
             layer_stride = num_blocks * block_stride
             address(layer l, block b) = kv.data_ptr() + l*layer_stride + b*block_stride

    conv     conv[mamba_layer, slot, conv_dim, conv_kernel-1]
             a slot's conv_dim rows are the sections [ x | B | C ], contiguous
    ssm      ssm[mamba_layer, slot, mamba_heads, mamba_head_dim, ssm_state_size]

Layer indices here are *local* (position in `attn_layers` / `mamba_layers`); the
spec maps them to global layer ids so stages with different splits line up.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from baton.model.config import ModelConfig


@dataclass(frozen=True)
class PoolSpec:
    attn_layers: tuple[int, ...]
    """Global ids of the attention layers this stage holds (empty: attention-free)."""
    mamba_layers: tuple[int, ...]
    """Global ids of the Mamba layers this stage holds (empty: Mamba-free)."""
    num_blocks: int
    tokens_per_block: int
    num_kv_heads: int
    head_dim: int
    num_slots: int
    conv_sections: tuple[int, int, int]
    conv_kernel: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    @classmethod
    def for_model(
        cls,
        model: ModelConfig,
        *,
        num_blocks: int,
        tokens_per_block: int,
        num_slots: int,
        layers: range | tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> PoolSpec:
        """Spec for the stage owning global `layers` (default: all layers)."""
        owned = set(range(model.num_layers) if layers is None else layers)
        attn = tuple(i for i in model.attention_layers if i in owned)
        mamba = tuple(i for i in model.mamba_layers if i in owned)
        return cls(
            attn_layers=attn,
            mamba_layers=mamba,
            num_blocks=num_blocks if attn else 0,
            tokens_per_block=tokens_per_block,
            num_kv_heads=model.num_key_value_heads if attn else 0,
            head_dim=model.head_dim,
            num_slots=num_slots if mamba else 0,
            conv_sections=model.conv_sections,
            conv_kernel=model.conv_kernel,
            mamba_num_heads=model.mamba_num_heads,
            mamba_head_dim=model.mamba_head_dim,
            ssm_state_size=model.ssm_state_size,
            dtype=dtype,
            device=device,
        )

    @property
    def conv_dim(self) -> int:
        return sum(self.conv_sections)

    @cached_property
    def attn_index(self) -> dict[int, int]:
        """Global layer id -> local index in the KV pool."""
        return {g: i for i, g in enumerate(self.attn_layers)}

    @cached_property
    def mamba_index(self) -> dict[int, int]:
        """Global layer id -> local index in the state pools."""
        return {g: i for i, g in enumerate(self.mamba_layers)}


class Pools:
    """The tensors of one stage, allocated once from a `PoolSpec`."""

    def __init__(self, spec: PoolSpec):
        self.spec = spec
        s = spec
        kv_shape = (len(s.attn_layers), s.num_blocks, 2, s.tokens_per_block, s.num_kv_heads, s.head_dim)
        conv_shape = (len(s.mamba_layers), s.num_slots, s.conv_dim, s.conv_kernel - 1)
        ssm_shape = (len(s.mamba_layers), s.num_slots, s.mamba_num_heads, s.mamba_head_dim, s.ssm_state_size)
        self.kv = torch.zeros(kv_shape, dtype=s.dtype, device=s.device)
        self.conv = torch.zeros(conv_shape, dtype=s.dtype, device=s.device)
        self.ssm = torch.zeros(ssm_shape, dtype=s.dtype, device=s.device)

    @property
    def has_kv(self) -> bool:
        return bool(self.spec.attn_layers)

    @property
    def has_state(self) -> bool:
        return bool(self.spec.mamba_layers)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one Mamba state slot (every layer, conv and SSM) onto another."""
        if self.has_state:
            self.conv[:, dst].copy_(self.conv[:, src])
            self.ssm[:, dst].copy_(self.ssm[:, src])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one KV block (every attention layer) onto another."""
        if self.has_kv:
            self.kv[:, dst].copy_(self.kv[:, src])

    def zero_slot(self, slot: int) -> None:
        if self.has_state:
            self.conv[:, slot].zero_()
            self.ssm[:, slot].zero_()

    def fill_block(self, block: int, value: float) -> None:
        """Every element of one KV block (every attention layer) set to `value`."""
        if self.has_kv:
            self.kv[:, block].fill_(value)

    def fill_slot(self, slot: int, value: float) -> None:
        """Every element of one state slot (conv and SSM, every Mamba layer) set to `value`."""
        if self.has_state:
            self.conv[:, slot].fill_(value)
            self.ssm[:, slot].fill_(value)
