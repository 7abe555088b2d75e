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

    state, one `TensorLayout` per declared state tensor t (model's `state_tensors` order):
            t[state_layer, slot, *shape]
    t.base ──►┌─────── local layer 0 ───────┐┌──── local layer 1 ───
              │ slot 0 │ slot 1 │ ... │ ns-1 ││ slot 0 │ ...
              │ s0|s1|s2 sections           ││
              └────────┴────────┴─────┴─────┘└────────┴────
              addr(l, s) = t.base + l*t.layer_stride + s*t.slot_stride, t.bytes long;
              section i starts sum(t.section_bytes[:i]) into the slot
              (NemotronH conv [ x | B | C ], ssm one section; Qwen3.5 conv [ q | k | v ],
               recurrent one section)
    snapshot slots (16-bit state, `PoolSpec.snapshot_slots`): one more `TensorLayout` per
    tensor in `snapshots`, in the snapshot pool's own dtype; slot ids continue the live ones
            slot s >= num_slots lies at snapshots[t].base + l*layer_stride
                                            + (s - num_slots)*slot_stride
    (a handoff of rounded state stages it there on both sides: docs/state-precision.md)

A stage owns *global* layer ids; `layers[i]` is the global id of local index i.
Attention-free stage: `kv is None` (its KV head count is 0, nothing divides by it).
State-free stage: `state is None` (no slot index is needed or checked).

Units: every (layer, block) KV range and every (layer, slot) range of each state tensor is
one "unit", numbered KV first, then each state tensor in declared order, then each
tensor's snapshot slots in declared order (see `unit_table`). NIXL preps the whole unit table once and posts transfers by unit index.
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
class TensorLayout:
    """One declared state tensor (`StateTensorSpec`) of every state layer of a stage."""

    name: str
    """The spec's name ("conv", "ssm", "recurrent", ...)."""
    base: int
    """Address of tensor[0, 0] (local layer 0, slot 0)."""
    layer_stride: int
    slot_stride: int
    bytes: int
    """Bytes of one slot of one layer."""
    section_bytes: tuple[int, ...]
    """Bytes of the spec's sections inside one slot, in order (contiguous, they sum to
    `bytes`): e.g. conv [x | B | C] or [q | k | v], SSM / recurrent state one section."""


@dataclass(frozen=True)
class StateLayout:
    layers: tuple[int, ...]
    """Global state layer ids, in local order."""
    num_slots: int
    tensors: tuple[TensorLayout, ...]
    """In the model's declared order; units follow this order."""
    snapshot_slots: int = 0
    """Snapshot-only slots (ids `num_slots` .. `num_slots + snapshot_slots - 1`)."""
    snapshots: tuple[TensorLayout, ...] = ()
    """Their pool, tensor by tensor in declared order, in its own (16-bit) dtype; empty
    when there is none."""

    def pool(self, slot: int) -> tuple[tuple[TensorLayout, ...], int, int]:
        """(tensors, index in their pool, rank of the pool in unit order: 0 live, 1
        snapshots) of slot id `slot` (checked by the caller)."""
        if slot < self.num_slots:
            return self.tensors, slot, 0
        return self.snapshots, slot - self.num_slots, 1

    def tensor(self, name: str) -> TensorLayout:
        for t in self.tensors:
            if t.name == name:
                return t
        raise TransferError(f"no state tensor {name!r} in this layout "
                            f"(has {[t.name for t in self.tensors]})")

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of one layer, every tensor."""
        return sum(t.bytes for t in self.tensors)


@dataclass(frozen=True)
class StageLayout:
    kv: KVLayout | None
    """None on an attention-free stage."""
    state: StateLayout | None
    """None on a state-free stage."""
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. "float32"."""
    device: str
    """"cpu" (NIXL DRAM) or "cuda" (NIXL VRAM)."""
    device_id: int
    """Device index (0 for DRAM)."""

    @classmethod
    def from_pools(cls, pools: Pools) -> StageLayout:
        s = pools.spec
        dev = pools.kv.device
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
            snaps = tuple(_tensor_layout(ts, pools.snapshots[ts.name])
                          for ts in s.state_tensors) if pools.snapshots else ()
            st = StateLayout(layers=tuple(s.state_layers), num_slots=s.num_slots,
                             tensors=tuple(_tensor_layout(ts, pools.state[ts.name])
                                           for ts in s.state_tensors),
                             snapshot_slots=s.snapshot_slots if snaps else 0, snapshots=snaps)
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
        """Units of one state tensor; each declared tensor has as many."""
        return len(self.state.layers) * self.state.num_slots if self.state else 0

    @property
    def num_snapshot_units(self) -> int:
        """Units of one state tensor's snapshot pool (0 without one)."""
        return len(self.state.layers) * self.state.snapshot_slots if self.state else 0

    def state_unit(self, i: int, slot: int) -> tuple[TensorLayout, int, int]:
        """(layout, first unit (local layer 0), units per layer) of declared state tensor
        `i` at slot id `slot`: the live pool's or the snapshot pool's."""
        s = self.state
        tensors, idx, pool = s.pool(slot)
        if pool == 0:
            return tensors[i], self.num_kv_units + i * self.num_state_units + idx, s.num_slots
        off = (self.num_kv_units + len(s.tensors) * self.num_state_units
               + i * self.num_snapshot_units)
        return tensors[i], off + idx, s.snapshot_slots

    def state_slot_bytes(self, slot: int) -> int:
        """Bytes slot id `slot` holds per layer, every tensor (live: float32; snapshot: its
        stored dtype)."""
        return sum(t.bytes for t in self.state.pool(slot)[0])

    def unit_table(self) -> np.ndarray:
        """All units as an Nx3 uint64 array (addr, bytes, device_id), unit-index order."""
        parts = []
        if self.kv:
            k = self.kv
            parts.append(_grid(k.base, k.layer_stride, len(k.layers),
                               k.block_stride, k.num_blocks, k.block_bytes))
        if self.state:
            s = self.state
            for t in s.tensors:
                parts.append(_grid(t.base, t.layer_stride, len(s.layers),
                                   t.slot_stride, s.num_slots, t.bytes))
            for t in s.snapshots:
                parts.append(_grid(t.base, t.layer_stride, len(s.layers),
                                   t.slot_stride, s.snapshot_slots, t.bytes))
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
        st = _state_from_wire(st) if st is not None else None
        for k, tp in (("dtype", str), ("device", str), ("device_id", int)):
            if not isinstance(d.get(k), tp) or isinstance(d.get(k), bool):
                raise TransferError(f"peer layout.{k} must be {tp.__name__}, got {d.get(k)!r}")
        return cls(kv=kv, state=st, dtype=d["dtype"], device=d["device"],
                   device_id=d["device_id"])


def _tensor_layout(ts, t) -> TensorLayout:
    _require_dense(t, 2, ts.name)
    it = t.element_size()
    return TensorLayout(
        name=ts.name, base=t.data_ptr(), layer_stride=t.stride(0) * it,
        slot_stride=t.stride(1) * it, bytes=t[0, 0].numel() * it,
        section_bytes=tuple(n * it for _, n in ts.section_elements()))


def _state_from_wire(d: object) -> StateLayout:
    if not isinstance(d, dict):
        raise TransferError(f"peer layout.state must be a map, got {type(d).__name__}")
    keys = {"layers", "num_slots", "tensors", "snapshot_slots", "snapshots"}
    if set(d) != keys:
        raise TransferError(f"peer layout.state has keys {sorted(map(str, d))}, expected "
                            f"{sorted(keys)}")
    ts, ss = d["tensors"], d["snapshots"]
    if not isinstance(ts, (list, tuple)) or not ts:
        raise TransferError(f"peer layout.state.tensors must be a non-empty list, got {ts!r}")
    if not isinstance(ss, (list, tuple)) or len(ss) not in (0, len(ts)):
        raise TransferError(f"peer layout.state.snapshots must be a list of {len(ts)} tensors "
                            f"or empty, got {ss!r}")
    tensors = tuple(_typed(TensorLayout, t, f"layout.state.tensors[{i}]")
                    for i, t in enumerate(ts))
    snaps = tuple(_typed(TensorLayout, t, f"layout.state.snapshots[{i}]")
                  for i, t in enumerate(ss))
    head = _typed(_StateHead, {"layers": d["layers"], "num_slots": d["num_slots"],
                               "snapshot_slots": d["snapshot_slots"]}, "layout.state")
    if bool(snaps) != bool(head.snapshot_slots):
        raise TransferError(f"peer layout.state.snapshot_slots={head.snapshot_slots} with "
                            f"{len(snaps)} snapshot tensors")
    return StateLayout(layers=head.layers, num_slots=head.num_slots, tensors=tensors,
                       snapshot_slots=head.snapshot_slots, snapshots=snaps)


@dataclass(frozen=True)
class _StateHead:
    layers: tuple[int, ...]
    num_slots: int
    snapshot_slots: int


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
        if f.name in ("layers", "section_bytes"):
            ok = isinstance(v, (list, tuple)) and all(_is_uint(x) for x in v)
            v = tuple(v) if ok else v
        elif f.name == "name":
            ok = isinstance(v, str) and 0 < len(v) <= 64
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
