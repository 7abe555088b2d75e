"""Where one tensor-parallel rank's bytes go: the decode ranks a reservation names, the pieces
this rank writes to each (`tp_plan`), how many writers each destination layer waits for, and
the check that a decode rank's layout is the one the pieces were planned for.

A decode worker's reservation lists every rank's side channel in `transfer_endpoint`
(comma-separated, signed with the rest of it); a rank of a TP-q worker carries its place:

    tcp://10.0.0.2:5301#tp=1/2      decode rank 1 of 2 (its pools: that shard of every tensor)
    tcp://10.0.0.2:5300             TP 1 (a whole-model stage, as before)

Each prefill rank r of TP p plans `plan_tp(shards(p), shards(q))` and posts only its own
pieces (`src_rank == r`) to each destination rank. A destination layer is complete once every
source rank with pieces for it there has landed (`parts`): each `landed` notification names
its source rank and, per layer, how many writers that layer has on that destination.

    prefill TP 2 -> decode TP 1, conv [x | B | C], n_groups 1:
      rank 0 writes x[0:I/2], B, C    rank 1 writes x[I/2:I]    (B, C: one writer only)
      KV with 1 KV head: rank 0 alone  ->  attention layers 1 part, Mamba layers 2 parts
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.errors import TransferError
from baton.model.tp_shard import TensorShard, model_shards
from transfer.layout import StageLayout
from transfer.tp_plan import Piece, plan_tp

MARK = "#tp="


def annotate(address: str, rank: int, size: int) -> str:
    """The endpoint of decode rank `rank` of `size` (plain address at TP 1)."""
    return address if size == 1 else f"{address}{MARK}{rank}/{size}"


def parse(endpoint: str) -> tuple[str, int, int]:
    """(side-channel address, TP rank, TP size) of one reservation endpoint."""
    address, mark, place = endpoint.partition(MARK)
    if not mark:
        return address, 0, 1
    rank, slash, size = place.partition("/")
    if not (slash and rank.isdigit() and size.isdigit()) or not 0 <= int(rank) < int(size):
        raise TransferError(f"reservation endpoint {endpoint!r}: the TP place must be "
                            "'#tp=RANK/SIZE' with 0 <= RANK < SIZE")
    return address, int(rank), int(size)


@dataclass
class TPSide:
    """This sender's rank of its TP group, and the whole model (to plan against any TP)."""

    rank: int
    size: int
    model: object
    """The whole (TP 1) model config."""
    dtype: str
    tokens_per_block: int
    kv_dtype: str | None = None
    """KV's stored dtype where not `dtype` (cache.kv_dtype)."""
    _plans: dict[int, tuple[Piece, ...]] = field(default_factory=dict)

    def shards(self, tp: int) -> tuple[TensorShard, ...]:
        return model_shards(self.model, tp, self.dtype, self.tokens_per_block, self.kv_dtype)

    def plan(self, dst_tp: int) -> tuple[Piece, ...]:
        if dst_tp not in self._plans:
            self._plans[dst_tp] = plan_tp(self.shards(self.size), self.shards(dst_tp))
        return self._plans[dst_tp]

    def pieces(self, dst_rank: int, dst_tp: int) -> tuple[Piece, ...]:
        """What this rank writes into decode rank `dst_rank` of `dst_tp` (maybe nothing)."""
        return tuple(p for p in self.plan(dst_tp)
                     if p.src_rank == self.rank and p.dst_rank == dst_rank)

    def parts(self, dst_rank: int, dst_tp: int, dst: StageLayout, layers) -> list[int]:
        """Per layer of `layers`: how many source ranks write it on that destination rank."""
        writers: dict[str, set[int]] = {}
        for p in self.plan(dst_tp):
            if p.dst_rank == dst_rank:
                writers.setdefault(p.tensor, set()).add(p.src_rank)
        kv = set(dst.kv.layers) if dst.kv else set()
        st = set(dst.state.layers) if dst.state else set()
        names = [t.name for t in dst.state.tensors] if dst.state else []
        out = []
        for g in layers:
            tensors = (["kv"] if g in kv else []) + (names if g in st else [])
            out.append(len(set().union(*(writers.get(t, set()) for t in tensors))))
        return out

    def check_peer(self, endpoint: str, dst_rank: int, dst_tp: int, fingerprint: dict,
                   layout: StageLayout) -> None:
        """Refuse, before a byte moves, a decode rank that is not the shard the reservation
        says: its handshake's TP place, and every tensor's per-block / per-slot bytes and
        sections, must be what `dst_rank` of `dst_tp` holds."""
        got = (fingerprint.get("tp_rank", 0), fingerprint.get("tp_size", 1))
        if got != (dst_rank, dst_tp):
            raise TransferError(
                f"decode peer {endpoint}: the reservation names TP rank {dst_rank} of "
                f"{dst_tp} but the peer is rank {got[0]} of {got[1]}; nothing was sent")
        for s in self.shards(dst_tp):
            if s.name == "kv":
                have = layout.kv.block_bytes if layout.kv else None
                want, secs, have_secs = s.local_bytes, None, None
            elif layout.state is None:
                continue
            else:
                t = layout.state.tensor(s.name)
                have, want = t.bytes, s.local_bytes
                row = s.inner * s.itemsize
                secs = [s.outer * x.local_units(dst_tp) * x.unit_width * row
                        for x in s.sections] if s.outer == 1 else None
                have_secs = list(t.section_bytes) if secs is not None else None
            if have is not None and (have != want or secs != have_secs):
                raise TransferError(
                    f"decode peer {endpoint}: its {s.name} shard is {have} bytes "
                    f"(sections {have_secs}) where TP rank {dst_rank} of {dst_tp} holds "
                    f"{want} (sections {secs}); the layouts do not map, nothing was sent")
