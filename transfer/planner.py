"""What to copy for one request between one prefill stage and one decode stage.

A pure function of two `StageLayout`s and the request's block ids / slots. The
pair covers the intersection of the two stages' global layers; blocks the
destination already holds (the first `skip_blocks`) are left out.

    prefill stage (layers 0-3)          decode stage (layers 2-5)
    kv layer 3: src blk 7 8 9 ...  ───► kv layer 3: dst blk 4 5 6 ...
    state layer 2: src slot 1      ───► state layer 2: dst slot 0  (each declared tensor)
    (a slot id past the live slots is a snapshot slot, 16-bit: staged on both sides)
                 (layers 0, 1 go to another decode stage; 4, 5 come from another prefill stage)

    one descriptor per (layer, block) and per (state tensor, layer, slot), layer-major:
      [kv l3 b7][kv l3 b8][kv l3 b9] ... [t0 l2 s1] ... [t1 l2 s1] ...
      (NemotronH t0 = conv, t1 = ssm; Qwen3.5 t0 = conv, t1 = recurrent)
    coalescing merges neighbours contiguous on BOTH sides:
      src 7,8,9 -> dst 4,5,6  is one range of 3*block_bytes
      src 7,8,9 -> dst 4,6,5  stays three ranges

Everything is built with numpy from base + index*stride; nothing loops per block.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from baton.errors import TransferError
from transfer.layout import StageLayout


class Plan(NamedTuple):
    layers: tuple[int, ...]
    """Global layer ids this pair moves (sorted); empty when the stages share none."""
    src_units: np.ndarray
    """int64 unit index in the source's unit table, one per descriptor."""
    dst_units: np.ndarray
    """int64 unit index in the destination's unit table."""
    src_addr: np.ndarray
    """uint64 source address of each descriptor."""
    dst_addr: np.ndarray
    """uint64 destination address of each descriptor."""
    length: np.ndarray
    """uint64 bytes of each descriptor."""
    unit_layer: np.ndarray
    """int64 global layer id of each descriptor (for layer-wise streaming)."""

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def select(self, layers: Sequence[int]) -> Plan:
        """The part of this plan that belongs to `layers`."""
        keep = np.isin(self.unit_layer, np.asarray(layers, dtype=np.int64))
        covered = tuple(g for g in self.layers if g in set(layers))
        return Plan(covered, *(a[keep] for a in self[1:]))

    def coalesced(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) as Nx2 uint64 (addr, bytes) with adjacent ranges merged."""
        return coalesce(self.src_addr, self.dst_addr, self.length)


def coalesce(src: np.ndarray, dst: np.ndarray, length: np.ndarray):
    """Merge descriptor i+1 into i where both sides continue exactly where i ends."""
    if length.size == 0:
        empty = np.zeros((0, 2), dtype=np.uint64)
        return empty, empty.copy()
    brk = np.ones(length.size, dtype=bool)
    brk[1:] = (src[1:] != src[:-1] + length[:-1]) | (dst[1:] != dst[:-1] + length[:-1])
    starts = np.flatnonzero(brk)
    lens = np.add.reduceat(length, starts)
    return np.stack([src[starts], lens], 1), np.stack([dst[starts], lens], 1)


def plan(src: StageLayout, dst: StageLayout, src_blocks: Sequence[int], src_slot: int | None,
         dst_blocks: Sequence[int], dst_slot: int | None, skip_blocks: int = 0) -> Plan:
    """Descriptors moving one request from stage `src` to stage `dst` (see module doc)."""
    if src.dtype != dst.dtype:
        raise TransferError(f"dtype differs: source {src.dtype}, destination {dst.dtype}")
    if len(src_blocks) != len(dst_blocks):
        raise TransferError(
            f"block tables differ in length: {len(src_blocks)} source, {len(dst_blocks)} "
            "destination; pass the full table on both sides and skip_blocks for held ones")
    if not 0 <= skip_blocks <= len(src_blocks):
        raise TransferError(f"skip_blocks={skip_blocks} outside 0..{len(src_blocks)}")
    parts = [_kv_part(src, dst, src_blocks[skip_blocks:], dst_blocks[skip_blocks:]),
             _state_part(src, dst, src_slot, dst_slot)]
    parts = [p for p in parts if p is not None]
    layers = tuple(sorted({g for p in parts for g in p[0]}))
    if not parts:
        e, u = np.zeros(0, np.int64), np.zeros(0, np.uint64)
        return Plan(layers, e, e, u, u, u, e)
    cols = [np.concatenate([p[i] for p in parts]) for i in range(1, 7)]
    return Plan(layers, *cols)


@functools.lru_cache(maxsize=256)
def _kv_pair(s, d) -> tuple[list[int], np.ndarray, np.ndarray] | None:
    """(common layers, their rows in s, in d) of two KV layouts; one per peer pair, cached:
    a one-block handoff's plan is mostly this fixed part (issue 53)."""
    common = sorted(set(s.layers) & set(d.layers))
    if not common:
        return None
    if s.block_bytes != d.block_bytes:
        raise TransferError(f"kv.block_bytes differs: source {s.block_bytes}, "
                            f"destination {d.block_bytes}")
    sl = np.array([s.layers.index(g) for g in common], dtype=np.int64)[:, None]
    dl = np.array([d.layers.index(g) for g in common], dtype=np.int64)[:, None]
    return common, _frozen(sl), _frozen(dl)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False  # shared by every plan of the pair
    return a


def _kv_part(src: StageLayout, dst: StageLayout, sb: Sequence[int], db: Sequence[int]):
    if src.kv is None or dst.kv is None:
        return None
    s, d = src.kv, dst.kv
    pair = _kv_pair(s, d)
    if pair is None:
        return None
    common, sl, dl = pair
    sb, db = _ids(sb, s.num_blocks, "source block"), _ids(db, d.num_blocks, "destination block")
    n = len(common) * sb.size
    return (common,
            (sl * s.num_blocks + sb).reshape(-1), (dl * d.num_blocks + db).reshape(-1),
            _addr(s.base, s.layer_stride, sl, s.block_stride, sb),
            _addr(d.base, d.layer_stride, dl, d.block_stride, db),
            np.full(n, s.block_bytes, dtype=np.uint64),
            np.repeat(np.array(common, dtype=np.int64), sb.size))


def _state_part(src: StageLayout, dst: StageLayout, ss: int | None, ds: int | None):
    """One descriptor per (declared state tensor, common layer): the slot's whole range,
    tensor by tensor in declared order (its sections are contiguous inside it)."""
    if src.state is None or dst.state is None:
        return None
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (ss, ds)):
        return _state_slots(src, dst, int(ss), int(ds))
    return _state_slots.__wrapped__(src, dst, ss, ds)  # refused (or no layer in common)


@functools.lru_cache(maxsize=1024)
def _state_slots(src: StageLayout, dst: StageLayout, ss, ds):
    """`_state_part` of valid slot ids (a pure function of the pair and the slots: cached).
    A slot id past the live ones is a snapshot slot (16-bit state staged for the handoff):
    both ends must then name pools of the same bytes per slot."""
    s, d = src.state, dst.state
    common = sorted(set(s.layers) & set(d.layers))
    if not common:
        return None
    _check_tensors(s, d)
    ss = int(_ids([ss], s.num_slots + s.snapshot_slots, "source slot")[0])
    ds = int(_ids([ds], d.num_slots + d.snapshot_slots, "destination slot")[0])
    sl = np.array([s.layers.index(g) for g in common], dtype=np.int64)
    dl = np.array([d.layers.index(g) for g in common], dtype=np.int64)
    glayers = np.array(common, dtype=np.int64)
    cols = [[] for _ in range(6)]
    for i in range(len(s.tensors)):
        st, s_off, s_per = src.state_unit(i, ss)
        dt, d_off, d_per = dst.state_unit(i, ds)
        if st.bytes != dt.bytes:
            raise TransferError(
                f"state.{st.name} slot bytes differ: source slot {ss} holds {st.bytes}, "
                f"destination slot {ds} holds {dt.bytes} (a 16-bit state goes from a snapshot "
                "slot to a snapshot slot, a float32 one from a live slot to a live slot)")
        si, di = s.pool(ss)[1], d.pool(ds)[1]
        for col, v in zip(cols, (
                s_off + sl * s_per, d_off + dl * d_per,
                _addr(st.base, st.layer_stride, sl, st.slot_stride, si),
                _addr(dt.base, dt.layer_stride, dl, dt.slot_stride, di),
                np.full(len(common), st.bytes, dtype=np.uint64), glayers), strict=True):
            col.append(v)
    return (common, *(_frozen(np.concatenate(c)) for c in cols))


def _check_tensors(s, d) -> None:
    """Both sides declare the same state tensors, in order, with the same byte sizes."""
    names = [t.name for t in s.tensors], [t.name for t in d.tensors]
    if names[0] != names[1]:
        raise TransferError(f"state tensors differ: source {names[0]}, destination {names[1]}")
    for st, dt in zip(s.tensors, d.tensors, strict=True):
        for f in ("bytes", "section_bytes"):
            if getattr(st, f) != getattr(dt, f):
                raise TransferError(f"state.{st.name}.{f} differs: source {getattr(st, f)}, "
                                    f"destination {getattr(dt, f)}")


def _ids(ids: Sequence[int | None], limit: int, what: str) -> np.ndarray:
    if any(i is None or isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in ids):
        raise TransferError(f"{what} ids must be integers, got {list(ids)[:8]}")
    a = np.asarray(ids, dtype=np.int64)
    bad = a[(a < 0) | (a >= limit)]
    if bad.size:
        raise TransferError(f"{what} id {int(bad[0])} outside the pool (0..{limit - 1})")
    return a


def _addr(base: int, ls: int, layers: np.ndarray, us: int, units) -> np.ndarray:
    u = np.asarray(units, dtype=np.uint64)
    a = np.uint64(base) + layers.astype(np.uint64) * np.uint64(ls) + u * np.uint64(us)
    return a.reshape(-1)
