"""Expected destination bytes after handoffs: the oracle for bit-exact transfer checks.

Works on raw pool dumps (`loopback` `dump` command) viewed as
    kv[local attn layer, block, block bytes]   <state name>[local state layer, slot, slot bytes]
and copies, per handoff and per global layer the destination owns, the source stage's
block / slot bytes over the destination's canary bytes. Comparing the whole expected
pool with the real one checks the moved bytes and every untouched block and slot at once.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from baton.model.pools import PoolSpec


class Handoff(NamedTuple):
    rid: str
    src_blocks: list[int]
    src_slot: int
    dst_blocks: list[int]
    dst_slot: int
    skip: int = 0


def split_layers(num_layers: int, pp: int) -> list[list[int]]:
    """Contiguous pipeline split of global layer ids, first stages one larger."""
    return [a.tolist() for a in np.array_split(np.arange(num_layers), pp)]


def views(dump: dict, spec: PoolSpec) -> dict[str, np.ndarray]:
    na, nm = len(spec.attn_layers), len(spec.state_layers)
    out = {"kv": np.frombuffer(dump["kv"], np.uint8).reshape(na, spec.num_blocks, -1)
           if na else np.zeros((0, 0, 0), np.uint8)}
    for t in spec.state_tensors:  # every declared state tensor, by name
        out[t.name] = np.frombuffer(dump[t.name], np.uint8).reshape(nm, spec.num_slots, -1) \
            if nm else np.zeros((0, 0, 0), np.uint8)
    return out


def expected_after(dst_spec: PoolSpec, dst_before: dict, sources: list[tuple[PoolSpec, dict]],
                   handoffs: list[Handoff]) -> dict[str, np.ndarray]:
    """Destination pools as they must be once every handoff landed."""
    exp = {k: v.copy() for k, v in views(dst_before, dst_spec).items()}
    srcs = [(spec, views(d, spec)) for spec, d in sources]
    for h in handoffs:
        for g in dst_spec.attn_layers:
            spec, v = next((s, v) for s, v in srcs if g in s.attn_index)
            sl, dl = spec.attn_index[g], dst_spec.attn_index[g]
            sb, db = np.array(h.src_blocks[h.skip:]), np.array(h.dst_blocks[h.skip:])
            if sb.size:
                exp["kv"][dl, db] = v["kv"][sl, sb]
        for g in dst_spec.mamba_layers:
            spec, v = next((s, v) for s, v in srcs if g in s.mamba_index)
            sl, dl = spec.mamba_index[g], dst_spec.mamba_index[g]
            for t in dst_spec.state_tensors:
                exp[t.name][dl, h.dst_slot] = v[t.name][sl, h.src_slot]
    return exp


def first_difference(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> str | None:
    """Human-readable location of the first differing byte, or None when bit-exact."""
    for k, e in expected.items():
        a = actual[k]
        if e.shape != a.shape:
            return f"{k}: shape {a.shape} != expected {e.shape}"
        bad = np.argwhere(e != a)
        if bad.size:
            layer, unit, byte = bad[0].tolist()
            return f"{k}[local layer {layer}, block/slot {unit}] byte {byte} differs"
    return None
