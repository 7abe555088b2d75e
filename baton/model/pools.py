"""The raw memory of one worker stage: paged KV blocks and recurrent state slots.

Allocated once at start; the cache manager owns the bookkeeping, the model reads and writes
the tensors, the transfer layer registers their addresses. The state tensors are whatever the
model's config declares (`config.state_tensors`, see `baton.model.state_spec`): nothing here
knows a layer kind.

    KV pool  kv[attn_layer, block, kv, token, kv_head, head_dim]      (kv: 0 = K, 1 = V)
             (fp8 KV: the last dim is head_dim + 4, each row's 4 bytes its float32 scale)
             |<------------- block_stride = 2*tpb*kvh*hd*itemsize ------------->|
             layer_stride = num_blocks * block_stride
             address(layer l, block b) = kv.data_ptr() + l*layer_stride + b*block_stride

    state    state[name][state_layer, slot, *spec.shape]     one tensor per declared name
             (NemotronH: conv [conv_dim, K-1] with sections [ x | B | C ], ssm [h, hd, ds];
              Qwen3.5: conv [q | k | v channels, K-1], recurrent [hv, dk, dv])
             address(layer l, slot s) = state[name].data_ptr() + l*layer_stride + s*slot_stride

Layer indices here are *local* (position in `attn_layers` / `state_layers`); the spec maps
them to global layer ids so stages with different splits line up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from baton.model.hugepages import huge_zeros
from baton.model.state_spec import StateTensorSpec

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_FILL = 0xA5
"""The byte `fill_block` writes into an fp8 KV pool (the test canaries)."""


@dataclass(frozen=True)
class PoolSpec:
    attn_layers: tuple[int, ...]
    """Global ids of the attention layers this stage holds (empty: attention-free)."""
    state_layers: tuple[int, ...]
    """Global ids of the recurrent-state layers this stage holds (empty: state-free)."""
    num_blocks: int
    tokens_per_block: int
    num_kv_heads: int
    head_dim: int
    num_slots: int
    state_tensors: tuple[StateTensorSpec, ...]
    """What one slot of one state layer holds, tensor by tensor (the model's declaration)."""
    snapshot_slots: int = 0
    """Snapshot-only slots stored apart from the live ones (ids `num_slots` ..
    `num_slots + snapshot_slots - 1`), each tensor in its `snapshot_dtypes` dtype; 0: one
    pool per tensor whose slots hold live states and snapshots alike
    (docs/state-precision.md)."""
    snapshot_dtypes: tuple[str, ...] = ()
    """The snapshot slots' dtype of each state tensor, in declared order (torch names)."""
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    kv_dtype: torch.dtype | None = None
    """Stored dtype of KV (None: `dtype`); float8_e4m3fn rows carry their scale
    (`kv_row`, `baton.model.kv_format`)."""

    @property
    def kv_store_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def kv_row(self) -> int:
        """Elements of one (token, KV head) row of the KV pool: head_dim, plus the 4 bytes of
        its float32 scale in an fp8 pool."""
        return self.head_dim + (4 if self.kv_store_dtype == FP8 else 0)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block over every attention layer of this stage (K, V and scales)."""
        return (len(self.attn_layers) * 2 * self.tokens_per_block * self.num_kv_heads
                * self.kv_row * self.kv_store_dtype.itemsize)

    @classmethod
    def kv_beside(cls, target: PoolSpec, attn_layers: tuple[int, ...], model) -> PoolSpec:
        """KV only, for `attn_layers` (an MTP head's), block for block beside `target`."""
        return cls(attn_layers=attn_layers, state_layers=(), num_blocks=target.num_blocks,
                   tokens_per_block=target.tokens_per_block,
                   num_kv_heads=model.num_key_value_heads, head_dim=model.head_dim,
                   num_slots=0, state_tensors=(), dtype=target.dtype, device=target.device,
                   kv_dtype=target.kv_dtype)

    @classmethod
    def for_model(
        cls,
        model,
        *,
        num_blocks: int,
        tokens_per_block: int,
        num_slots: int,
        layers: range | tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        kv_dtype: torch.dtype | None = None,
    ) -> PoolSpec:
        """Spec for the stage owning global `layers` (default: all layers) of any family's
        config (`attention_layers`, `state_layers`, `state_tensors`, KV heads and size)."""
        owned = set(range(model.num_layers) if layers is None else layers)
        attn = tuple(i for i in model.attention_layers if i in owned)
        state = tuple(i for i in model.state_layers if i in owned)
        return cls(
            attn_layers=attn,
            state_layers=state,
            num_blocks=num_blocks if attn else 0,
            tokens_per_block=tokens_per_block,
            num_kv_heads=model.num_key_value_heads if attn else 0,
            head_dim=model.head_dim,
            num_slots=num_slots if state else 0,
            state_tensors=tuple(model.state_tensors),
            dtype=dtype,
            device=device,
            kv_dtype=None if kv_dtype == dtype else kv_dtype,
        )

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        """Older name of `state_layers`."""
        return self.state_layers

    @cached_property
    def attn_index(self) -> dict[int, int]:
        """Global layer id -> local index in the KV pool."""
        return {g: i for i, g in enumerate(self.attn_layers)}

    @cached_property
    def state_index(self) -> dict[int, int]:
        """Global layer id -> local index in the state pools."""
        return {g: i for i, g in enumerate(self.state_layers)}

    @property
    def mamba_index(self) -> dict[int, int]:
        return self.state_index

    def state_dtype(self, t: StateTensorSpec) -> torch.dtype:
        return getattr(torch, t.dtype) if t.dtype else self.dtype

    def snapshot_dtype(self, t: StateTensorSpec) -> torch.dtype:
        """The dtype a snapshot of `t` is stored in (the live dtype unless split)."""
        if not self.snapshot_slots:
            return self.state_dtype(t)
        return getattr(torch, self.snapshot_dtypes[self.state_tensors.index(t)])

    def state_bytes_per_slot(self) -> int:
        """Bytes of one (live) slot over every state layer of this stage (all tensors)."""
        return len(self.state_layers) * sum(
            t.numel * self.state_dtype(t).itemsize for t in self.state_tensors)

    def snapshot_bytes_per_slot(self) -> int:
        """Bytes of one snapshot slot over every state layer (all tensors, stored dtype)."""
        return len(self.state_layers) * sum(
            t.numel * self.snapshot_dtype(t).itemsize for t in self.state_tensors)

    def state_bytes(self) -> int:
        """Bytes of every state slot of this stage, live and snapshot."""
        return (self.num_slots * self.state_bytes_per_slot()
                + self.snapshot_slots * self.snapshot_bytes_per_slot())

    def split_snapshots(self, live_slots: int, dtypes: dict[str, torch.dtype]) -> PoolSpec:
        """This spec with `live_slots` slots in the live dtype and the rest of `num_slots`
        as snapshot slots stored in `dtypes` (by tensor name); unchanged when every dtype
        is the live one or no slot is left for snapshots."""
        names = [t.name for t in self.state_tensors]
        if (not self.state_layers or self.num_slots <= live_slots
                or all(dtypes.get(t.name, self.state_dtype(t)) == self.state_dtype(t)
                       for t in self.state_tensors)):
            return self
        stored = tuple(str(dtypes.get(n, self.state_dtype(t))).removeprefix("torch.")
                       for n, t in zip(names, self.state_tensors, strict=True))
        return dataclasses.replace(self, num_slots=live_slots,
                                   snapshot_slots=self.num_slots - live_slots,
                                   snapshot_dtypes=stored)


class Pools:
    """The tensors of one stage, allocated once from a `PoolSpec`."""

    def __init__(self, spec: PoolSpec):
        self.spec = s = spec
        kv_shape = (len(s.attn_layers), s.num_blocks, 2, s.tokens_per_block, s.num_kv_heads,
                    s.kv_row)
        # on huge pages where the machine offers them: a batch-32 step reads and writes every
        # state slot of its batch and reads its KV (hugepages.py)
        self.kv = huge_zeros(kv_shape, dtype=s.kv_store_dtype, device=s.device)
        self.state: dict[str, torch.Tensor] = {
            t.name: huge_zeros((len(s.state_layers), s.num_slots, *t.shape),
                               dtype=s.state_dtype(t), device=s.device)
            for t in s.state_tensors
        }
        self.snapshots: dict[str, torch.Tensor] = {
            t.name: huge_zeros((len(s.state_layers), s.snapshot_slots, *t.shape),
                               dtype=s.snapshot_dtype(t), device=s.device)
            for t in s.state_tensors
        } if s.snapshot_slots and s.state_layers else {}
        """Snapshot-only slots in their stored dtype (`PoolSpec.snapshot_slots`), by name."""

    def slot(self, name: str, slot: int) -> torch.Tensor:
        """State tensor `name` of slot `slot`, every layer: [layers, *shape] (a view)."""
        n = self.spec.num_slots
        if slot < n:
            return self.state[name][:, slot]
        return self.snapshots[name][:, slot - n]

    def __getattr__(self, name: str) -> torch.Tensor:
        # `pools.conv` for `pools.state["conv"]`: the declared names read like attributes.
        state = self.__dict__.get("state")
        if state is not None and name in state:
            return state[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or state tensor {name!r}")

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every pool tensor, KV first, then the state tensors in declared order, then their
        snapshot pools (what a transfer backend registers)."""
        return [self.kv, *self.state.values(), *self.snapshots.values()]

    @property
    def has_kv(self) -> bool:
        return bool(self.spec.attn_layers)

    @property
    def has_state(self) -> bool:
        return bool(self.spec.state_layers)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one state slot (every layer, every state tensor) onto another. Between a live
        and a snapshot slot the copy narrows or widens the dtype: lossless for a state
        rounded to the snapshot dtype first (baton/engine/state_rounding.py)."""
        if self.has_state:
            for name in self.state:
                self.slot(name, dst).copy_(self.slot(name, src))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one KV block (every attention layer) onto another."""
        if self.has_kv:
            self.kv[:, dst].copy_(self.kv[:, src])

    def copy_token(self, src: int, dst: int) -> None:
        """Copy the K/V of one token position (every attention layer) onto another; a
        position is block * tokens_per_block + offset (tree drafts' kept rows)."""
        if self.has_kv:
            tpb = self.spec.tokens_per_block
            self.kv[:, dst // tpb, :, dst % tpb].copy_(self.kv[:, src // tpb, :, src % tpb])

    def zero_slot(self, slot: int) -> None:
        if self.has_state:
            for name in self.state:
                self.slot(name, slot).zero_()

    def fill_block(self, block: int, value: float) -> None:
        """Every element of one KV block (every attention layer) set to `value` (an fp8
        pool, whose rows hold scales too: every byte set to FP8_FILL, whatever `value`)."""
        if self.has_kv:
            if self.kv.dtype == FP8:
                self.kv.view(torch.uint8)[:, block].fill_(FP8_FILL)
            else:
                self.kv[:, block].fill_(value)

    def fill_slot(self, slot: int, value: float) -> None:
        """Every element of one state slot (every tensor, every state layer) set to `value`."""
        if self.has_state:
            for name in self.state:
                self.slot(name, slot).fill_(value)
