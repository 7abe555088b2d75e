"""Heterogeneous tensor-parallel transfer plan: which prefill rank writes which bytes of
which decode rank (a pure function of the two sides' shard layouts).

For every cache tensor (KV block, each declared state tensor's slot), every section of it,
every destination rank d and every unit (head, group) d holds, the writer is ONE source
rank holding that unit: the holder nearest d's aligned source rank d*src_tp // dst_tp
(ties to the lower). So replicated data (KV heads fewer than TP, Mamba2 B/C with
n_groups == 1) is written by exactly one source per destination copy, equal TP sizes pair
rank d with rank d only, and every destination byte gets exactly one write.

    conv [x | B | C], prefill TP 1 -> decode TP 2, n_groups 1 (B, C replicated):
    src rank 0: [ x0 x1 | B | C ]
                   │  │   │   │
    dst rank 0: [ x0 | B | C ]     three pieces from src 0: x0, B, C (each section alone)
    dst rank 1: [ x1 | B | C ]     three pieces from src 0: x1, B, C (B at B's offset,
                                   not ratio-scaled into C)

A `Piece` is relative to one block / slot of one layer: `repeat` runs of `length` bytes,
`src_stride` / `dst_stride` apart (KV heads sit inside each token row, so a head range
repeats 2*tokens_per_block times; state tensors shard their outermost axis: repeat 1).
`expand` turns one (source rank, destination rank) pair's pieces into the per-stage
planner's `Plan` (addresses) for the layers both ranks' stages hold, so PP on either side
composes: each (prefill stage, decode stage) pair is planned with its ranks' layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from baton.errors import TransferError
from baton.model.tp_shard import TensorShard, held_units
from transfer.layout import StageLayout
from transfer.planner import Plan, _ids


class Piece(NamedTuple):
    tensor: str
    src_rank: int
    dst_rank: int
    src_offset: int
    """Bytes into the source rank's block / slot of this tensor."""
    dst_offset: int
    length: int
    """Bytes per run."""
    repeat: int
    src_stride: int
    dst_stride: int

    @property
    def nbytes(self) -> int:
        return self.length * self.repeat


def plan_tp(src: Sequence[TensorShard], dst: Sequence[TensorShard]) -> tuple[Piece, ...]:
    """Every piece from every source rank to every destination rank (module doc)."""
    if [t.name for t in src] != [t.name for t in dst]:
        raise TransferError(f"cache tensors differ: source {[t.name for t in src]}, "
                            f"destination {[t.name for t in dst]}")
    out: list[Piece] = []
    for s, d in zip(src, dst, strict=True):
        _check_pair(s, d)
        for dr in range(d.tp):
            out += _merge([p for i in range(len(d.sections)) for p in _section(s, d, i, dr)])
    return tuple(out)


def pieces_for(plan: Sequence[Piece], src_rank: int) -> tuple[Piece, ...]:
    """What one source rank writes (each prefill rank posts only its own)."""
    return tuple(p for p in plan if p.src_rank == src_rank)


def _check_pair(s: TensorShard, d: TensorShard) -> None:
    for f in ("shape", "shard_axis", "itemsize"):
        if getattr(s, f) != getattr(d, f):
            raise TransferError(f"{s.name}.{f} differs: source {getattr(s, f)}, destination "
                                f"{getattr(d, f)}")
    su = [(x.units, x.unit_width) for x in s.sections]
    du = [(x.units, x.unit_width) for x in d.sections]
    if su != du:
        raise TransferError(f"{s.name} sections differ: source (units, width) {su}, "
                            f"destination {du}")


def _holder(units: int, tp: int, unit: int, prefer: int) -> tuple[int, int]:
    """(the rank holding `unit` nearest `prefer`, ties to the lower; its first unit)."""
    held = [(abs(r - prefer), r, lo) for r in range(tp)
            for lo, hi in [held_units(units, tp, r)] if lo <= unit < hi]
    if not held:
        raise TransferError(f"unit {unit} of {units} is held by no rank of {tp}")
    return min(held)[1:]


def _section(s: TensorShard, d: TensorShard, i: int, dr: int) -> list[Piece]:
    """Pieces filling section i of destination rank dr, one per run of units that come
    from the same source rank and are consecutive on both sides."""
    sec = d.sections[i]
    lo, hi = held_units(sec.units, d.tp, dr)
    runs: list[list[int]] = []  # [src_rank, src_unit0, dst_unit0, count]
    for u in range(lo, hi):
        sr, slo = _holder(sec.units, s.tp, u, dr * s.tp // d.tp)
        if runs and runs[-1][0] == sr and runs[-1][1] + runs[-1][3] == u - slo:
            runs[-1][3] += 1
        else:
            runs.append([sr, u - slo, u - lo, 1])
    row = s.inner * s.itemsize  # bytes of one index along the shard axis
    s_stride, d_stride = s.local_axis * row, d.local_axis * row
    out = []
    for sr, su, du, n in runs:
        w = sec.unit_width
        out.append(Piece(s.name, sr, dr, (s.section_start(i) + su * w) * row,
                         (d.section_start(i) + du * w) * row, n * w * row, s.outer,
                         s_stride, d_stride))
    return out


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Join neighbours contiguous on both sides (same ranks), then fold a run that covers
    its whole stride on both sides into one range (TP equal on both sides: one piece)."""
    out: list[Piece] = []
    for p in pieces:
        q = out[-1] if out else None
        if (q is not None and (q.src_rank, q.dst_rank, q.repeat, q.src_stride, q.dst_stride)
                == (p.src_rank, p.dst_rank, p.repeat, p.src_stride, p.dst_stride)
                and q.src_offset + q.length == p.src_offset
                and q.dst_offset + q.length == p.dst_offset):
            out[-1] = q._replace(length=q.length + p.length)
        else:
            out.append(p)
    return [p._replace(length=p.nbytes, repeat=1)
            if p.repeat > 1 and p.length == p.src_stride == p.dst_stride else p for p in out]


def expand(pieces: Sequence[Piece], src: StageLayout, dst: StageLayout,
           src_blocks: Sequence[int], src_slot: int | None, dst_blocks: Sequence[int],
           dst_slot: int | None, skip_blocks: int = 0) -> Plan:
    """Descriptors of one rank pair's pieces over the layers both stages hold: KV pieces
    per (layer, block after `skip_blocks`, run), state pieces per (layer, run) of the slot.
    Every run is checked inside its block / slot on both sides before anything is built
    (a layout the pieces were not planned for is refused, not written)."""
    if len(src_blocks) != len(dst_blocks):
        raise TransferError(f"block tables differ in length: {len(src_blocks)} source, "
                            f"{len(dst_blocks)} destination")
    cols: list[list[np.ndarray]] = [[] for _ in range(6)]
    for p in pieces:
        part = _kv(p, src, dst, src_blocks[skip_blocks:], dst_blocks[skip_blocks:]) \
            if p.tensor == "kv" else _state(p, src, dst, src_slot, dst_slot)
        for c, v in zip(cols, part or (), strict=False):
            c.append(v)
    if not cols[0]:
        e, u = np.zeros(0, np.int64), np.zeros(0, np.uint64)
        return Plan((), e, e, u, u, u, e)
    out = [np.concatenate(c) for c in cols]
    layers = tuple(sorted({int(g) for g in np.unique(out[5])}))
    return Plan(layers, out[0], out[1], out[2], out[3], out[4], out[5])


def _runs(p: Piece, src_bytes: int, dst_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    k = np.arange(p.repeat, dtype=np.uint64)
    so = np.uint64(p.src_offset) + k * np.uint64(p.src_stride)
    do = np.uint64(p.dst_offset) + k * np.uint64(p.dst_stride)
    if int(so[-1]) + p.length > src_bytes or int(do[-1]) + p.length > dst_bytes:
        raise TransferError(f"{p.tensor} piece {p.src_rank}->{p.dst_rank} runs past a "
                            f"{src_bytes}-byte source or {dst_bytes}-byte destination unit: "
                            "the peer's shard layout is not the one planned")
    return so, do


def _grid(base, ls, layers, us, units, offs) -> np.ndarray:
    """base + layer*ls + unit*us + off, layer-major, then unit, then run."""
    a = (np.uint64(base) + layers.astype(np.uint64)[:, None, None] * np.uint64(ls)
         + np.asarray(units, dtype=np.uint64)[None, :, None] * np.uint64(us)
         + offs[None, None, :])
    return a.reshape(-1)


def _units(layers: np.ndarray, per_layer: int, ids: np.ndarray, repeat: int) -> np.ndarray:
    """Unit index of every run (the block's unit: NIXL posts whole units, so a sub-block
    run needs the address path, e.g. UCX's coalesced ranges)."""
    return np.repeat((layers[:, None] * per_layer + ids[None, :]).reshape(-1), repeat)


def _kv(p: Piece, src: StageLayout, dst: StageLayout, sb, db):
    if src.kv is None or dst.kv is None:
        return None
    s, d = src.kv, dst.kv
    common = sorted(set(s.layers) & set(d.layers))
    if not common or not len(sb):
        return None
    so, do = _runs(p, s.block_bytes, d.block_bytes)
    sb, db = _ids(sb, s.num_blocks, "source block"), _ids(db, d.num_blocks, "destination block")
    sl = np.array([s.layers.index(g) for g in common], dtype=np.int64)
    dl = np.array([d.layers.index(g) for g in common], dtype=np.int64)
    n = len(common) * sb.size * p.repeat
    return (_units(sl, s.num_blocks, sb, p.repeat), _units(dl, d.num_blocks, db, p.repeat),
            _grid(s.base, s.layer_stride, sl, s.block_stride, sb, so),
            _grid(d.base, d.layer_stride, dl, d.block_stride, db, do),
            np.full(n, p.length, dtype=np.uint64),
            np.repeat(np.array(common, dtype=np.int64), sb.size * p.repeat))


def _state(p: Piece, src: StageLayout, dst: StageLayout, ss, ds):
    """A state piece over the layers both stages hold. A slot id past the live ones is a
    snapshot slot (16-bit state staged for the handoff, docs/state-precision.md): the piece,
    planned in the live pools' bytes, is rescaled to that pool's element size; both ends
    must then name pools of the same element size (snapshot to snapshot, live to live)."""
    if src.state is None or dst.state is None:
        return None
    s, d = src.state, dst.state
    common = sorted(set(s.layers) & set(d.layers))
    if not common:
        return None
    i = [t.name for t in s.tensors].index(p.tensor)
    ss = int(_ids([ss], s.num_slots + s.snapshot_slots, "source slot")[0])
    ds = int(_ids([ds], d.num_slots + d.snapshot_slots, "destination slot")[0])
    st, s_off, s_per = src.state_unit(i, ss)
    dt, d_off, d_per = dst.state_unit(i, ds)
    p = _stored(p, s.tensors[i].bytes, st.bytes, d.tensors[i].bytes, dt.bytes, ss, ds)
    so, do = _runs(p, st.bytes, dt.bytes)
    si, di = s.pool(ss)[1], d.pool(ds)[1]
    sl = np.array([s.layers.index(g) for g in common], dtype=np.int64)
    dl = np.array([d.layers.index(g) for g in common], dtype=np.int64)
    return (np.repeat(s_off + sl * s_per, p.repeat),
            np.repeat(d_off + dl * d_per, p.repeat),
            _grid(st.base, st.layer_stride, sl, st.slot_stride, [si], so),
            _grid(dt.base, dt.layer_stride, dl, dt.slot_stride, [di], do),
            np.full(len(common) * p.repeat, p.length, dtype=np.uint64),
            np.repeat(np.array(common, dtype=np.int64), p.repeat))


def _stored(p: Piece, s_live: int, s_bytes: int, d_live: int, d_bytes: int, ss: int,
            ds: int) -> Piece:
    """`p` (bytes of the live, model-dtype slots it was planned in) in the bytes of the
    slots it moves: a 16-bit snapshot slot holds s_bytes / s_live of them per element."""
    if s_bytes * d_live != d_bytes * s_live:
        raise TransferError(
            f"state.{p.tensor} slot bytes differ: source slot {ss} holds {s_bytes} of "
            f"{s_live} live bytes, destination slot {ds} holds {d_bytes} of {d_live} (a 16-bit "
            "state goes from a snapshot slot to a snapshot slot, a float32 one from a live "
            "slot to a live slot); nothing was sent")
    if s_bytes == s_live:
        return p
    vals = (p.src_offset, p.dst_offset, p.length, p.src_stride, p.dst_stride)
    if any(v * s_bytes % s_live for v in vals):
        raise TransferError(f"state.{p.tensor} piece {p.src_rank}->{p.dst_rank} does not "
                            f"fall on whole elements of the {s_bytes}-byte snapshot slot; "
                            "nothing was sent")
    so, do, n, sst, dst_ = (v * s_bytes // s_live for v in vals)
    return p._replace(src_offset=so, dst_offset=do, length=n, src_stride=sst, dst_stride=dst_)
