"""One stage's pool memory as plain integers: what a peer needs to address it.

Built from real `Pools`; crosses the side channel as a msgpack dict (`to_wire` /
`from_wire`), so the peer never sees a tensor object, only addresses and strides.

    KV  (kv[attn_layer, block, 2, tpb, kvh, hd], K then V inside one block)

    base ──►┌──────────── local layer 0 ────────────┐┌──── local layer 1 ───
            │ blk 0 │ blk 1 │  ...  │ blk nb-1      ││ blk 0 │ ...
            │ K | V │ K | V │       │               ││       │
            └───────┴───────┴───────┴───────────────┘└───────┴────
            |<-bs-->|                                 bs = block_stride
            |<----------- layer_stride ------------->|
            addr(l, b) = base + l*layer_stride + b*block_stride, block_bytes long
            (V starts k_bytes into the block)

    state (conv[mamba_layer, slot, conv_dim, k-1], ssm[mamba_layer, slot, h, hd, ds])
            conv slot = [ x | B | C ] rows, conv_section_bytes each, contiguous
            addr(l, s) = conv_base + l*conv_layer_stride + s*conv_slot_stride
                         ssm_base  + l*ssm_layer_stride  + s*ssm_slot_stride

A stage owns *global* layer ids; `layers[i]` is the global id of local index i.
Attention-free stage: `kv is None` (its KV head count is 0, nothing divides by it).
Mamba-free stage: `state is None` (no slot index is needed or checked).

Units: every (layer, block) KV range and (layer, slot) conv / SSM range is one
"unit", numbered KV first, then conv, then SSM (see `unit_table`). NIXL preps
the whole unit table once and posts transfers by unit index.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from baton.errors import TransferError
from baton.model.pools import Pools


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[int, ...]
    """Global attention layer ids, in local order."""
    base: int
    """Address of kv[0, 0]."""
    layer_stride: int
    """Bytes from one local layer to the next."""
    block_stride: int
    """Bytes from one block to the next within a layer."""
    block_bytes: int
    """Bytes of one block of one layer (K and V together)."""
    k_bytes: int
    """Bytes of K inside a block; V follows at this offset."""
    num_blocks: int
    """Blocks per layer."""


@dataclass(frozen=True)
class StateLayout:
    layers: tuple[int, ...]
    """Global Mamba layer ids, in local order."""
    conv_base: int
    """Address of conv[0, 0]."""
    conv_layer_stride: int
    conv_slot_stride: int
    conv_bytes: int
    """Bytes of one conv slot of one layer."""
    conv_section_bytes: tuple[int, int, int]
    """Bytes of the [x | B | C] sections inside a conv slot, in order."""
    ssm_base: int
    """Address of ssm[0, 0]."""
    ssm_layer_stride: int
    ssm_slot_stride: int
    ssm_bytes: int
    """Bytes of one SSM slot of one layer."""
    num_slots: int


@dataclass(frozen=True)
class StageLayout:
    kv: KVLayout | None
    """None on an attention-free stage."""
    state: StateLayout | None
    """None on a Mamba-free stage."""
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. "float32"."""
    device: str
    """"cpu" (NIXL DRAM) or "cuda" (NIXL VRAM)."""
    device_id: int
    """Device index (0 for DRAM)."""

    @classmethod
    def from_pools(cls, pools: Pools) -> StageLayout:
        s = pools.spec
        dev = pools.kv.device if pools.has_kv else pools.conv.device
        kv = st = None
        if pools.has_kv:
            t = pools.kv
            _require_dense(t, 2, "kv")
            it = t.element_size()
            kv = KVLayout(
                layers=tuple(s.attn_layers), base=t.data_ptr(),
                layer_stride=t.stride(0) * it, block_stride=t.stride(1) * it,
                block_bytes=t[0, 0].numel() * it, k_bytes=t[0, 0, 0].numel() * it,
                num_blocks=t.shape[1],
            )
        if pools.has_state:
            c, m = pools.conv, pools.ssm
            _require_dense(c, 2, "conv")
            _require_dense(m, 2, "ssm")
            it = c.element_size()
            row = c.shape[3] * it
            st = StateLayout(
                layers=tuple(s.mamba_layers), conv_base=c.data_ptr(),
                conv_layer_stride=c.stride(0) * it, conv_slot_stride=c.stride(1) * it,
                conv_bytes=c[0, 0].numel() * it,
                conv_section_bytes=tuple(n * row for n in s.conv_sections),
                ssm_base=m.data_ptr(), ssm_layer_stride=m.stride(0) * it,
                ssm_slot_stride=m.stride(1) * it, ssm_bytes=m[0, 0].numel() * it,
                num_slots=c.shape[1],
            )
        return cls(kv=kv, state=st, dtype=str(s.dtype).removeprefix("torch."),
                   device=dev.type, device_id=dev.index or 0)

    @property
    def layers(self) -> frozenset[int]:
        """Every global layer id that has cache on this stage."""
        kv = self.kv.layers if self.kv else ()
        st = self.state.layers if self.state else ()
        return frozenset(kv) | frozenset(st)

    @property
    def num_kv_units(self) -> int:
        return len(self.kv.layers) * self.kv.num_blocks if self.kv else 0

    @property
    def num_state_units(self) -> int:
        """Conv units; SSM units are as many again."""
        return len(self.state.layers) * self.state.num_slots if self.state else 0

    def unit_table(self) -> np.ndarray:
        """All units as an Nx3 uint64 array (addr, bytes, device_id), unit-index order."""
        parts = []
        if self.kv:
            k = self.kv
            parts.append(_grid(k.base, k.layer_stride, len(k.layers),
                               k.block_stride, k.num_blocks, k.block_bytes))
        if self.state:
            s = self.state
            n = len(s.layers)
            parts.append(_grid(s.conv_base, s.conv_layer_stride, n,
                               s.conv_slot_stride, s.num_slots, s.conv_bytes))
            parts.append(_grid(s.ssm_base, s.ssm_layer_stride, n,
                               s.ssm_slot_stride, s.num_slots, s.ssm_bytes))
        if not parts:
            return np.zeros((0, 3), dtype=np.uint64)
        table = np.concatenate(parts)
        table[:, 2] = self.device_id
        return table

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, d: object) -> StageLayout:
        """Rebuild from a peer's dict, refusing anything that is not exactly a layout."""
        if not isinstance(d, dict):
            raise TransferError(f"peer layout must be a map, got {type(d).__name__}")
        kv = _typed(KVLayout, d.get("kv"), "layout.kv") if d.get("kv") is not None else None
        st = d.get("state")
        st = _typed(StateLayout, st, "layout.state") if st is not None else None
        for k, tp in (("dtype", str), ("device", str), ("device_id", int)):
            if not isinstance(d.get(k), tp) or isinstance(d.get(k), bool):
                raise TransferError(f"peer layout.{k} must be {tp.__name__}, got {d.get(k)!r}")
        return cls(kv=kv, state=st, dtype=d["dtype"], device=d["device"],
                   device_id=d["device_id"])


def _grid(base: int, ls: int, nl: int, us: int, nu: int, nbytes: int) -> np.ndarray:
    addr = (np.uint64(base) + np.arange(nl, dtype=np.uint64)[:, None] * np.uint64(ls)
            + np.arange(nu, dtype=np.uint64)[None, :] * np.uint64(us)).reshape(-1)
    out = np.zeros((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = nbytes
    return out


def _require_dense(t, from_dim: int, name: str) -> None:
    inner = t[(0,) * from_dim]
    if not inner.is_contiguous():
        raise TransferError(f"pool {name}: one block/slot must be contiguous memory")


def _typed(cls, d: object, where: str):
    if not isinstance(d, dict):
        raise TransferError(f"peer {where} must be a map, got {type(d).__name__}")
    kwargs = {}
    for f in fields(cls):
        v = d.get(f.name)
        if f.name in ("layers", "conv_section_bytes"):
            ok = isinstance(v, (list, tuple)) and all(_is_uint(x) for x in v)
            v = tuple(v) if ok else v
        else:
            ok = _is_uint(v)
        if not ok:
            raise TransferError(f"peer {where}.{f.name} is malformed: {v!r}")
        kwargs[f.name] = v
    if set(d) - set(kwargs):
        raise TransferError(f"peer {where} has unknown keys {sorted(map(str, set(d) - set(kwargs)))}")
    return cls(**kwargs)


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64
