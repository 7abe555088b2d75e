"""Which part of every cache tensor a tensor-parallel rank holds (pure, no torch).

A cache tensor is sharded along one axis (`StateTensorSpec.shard_axis`; KV: the head axis)
section by section. A section of `units` shardable units (heads, groups), each
`unit_width` indices wide, over `tp` ranks:

    units % tp == 0   split: rank r holds units [r*units/tp, (r+1)*units/tp)
    tp % units == 0   replicated: rank r holds unit r*units // tp (= r // (tp/units)),
                      so each unit sits on tp/units neighbouring ranks (KV heads fewer
                      than TP; Mamba2 B/C with n_groups == 1 on every rank)
    otherwise         refused (`ConfigError` naming the section, its units and the sizes
                      that would divide)

    a Mamba2 conv (channels, K-1), TP 2, n_groups 1: rank r's slot is
        [ x[r*I/2:(r+1)*I/2] | B (all N) | C (all N) ]     each section sliced on its own
    KV block (2, tpb, kv_heads, hd), TP 4, 2 KV heads: ranks 0,1 hold head 0; 2,3 head 1
        (division, not modulo: r % 2 would give ranks 0,2 head 0).

`model_shards` lists the KV tensor then the declared state tensors of a model at one TP
size; `check_tp` refuses a model / TP pair before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from baton.errors import ConfigError
from baton.model.state_spec import StateTensorSpec

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1,
               "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def held_units(units: int, tp: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the section's units that rank `rank` of `tp` holds (module doc)."""
    if units % tp == 0:
        per = units // tp
        return rank * per, rank * per + per
    if tp % units == 0:
        u = rank * units // tp
        return u, u + 1
    raise ConfigError(f"{units} units cannot be split over tensor_parallel_size={tp}")


@dataclass(frozen=True)
class SectionShard:
    name: str
    units: int
    """Units of the whole section (TP 1)."""
    unit_width: int
    """Indices along the shard axis per unit."""

    def local_units(self, tp: int) -> int:
        return max(self.units // tp, 1)


@dataclass(frozen=True)
class TensorShard:
    """One cache tensor (one block of KV, one slot of a state tensor) at TP size `tp`."""

    name: str
    shape: tuple[int, ...]
    """Global (TP 1) shape of one block / slot."""
    shard_axis: int
    sections: tuple[SectionShard, ...]
    tp: int
    itemsize: int

    @property
    def outer(self) -> int:
        return prod(self.shape[:self.shard_axis])

    @property
    def inner(self) -> int:
        return prod(self.shape[self.shard_axis + 1:])

    @property
    def local_axis(self) -> int:
        """Indices along the shard axis on one rank."""
        return sum(s.local_units(self.tp) * s.unit_width for s in self.sections)

    @property
    def local_shape(self) -> tuple[int, ...]:
        a = self.shard_axis
        return (*self.shape[:a], self.local_axis, *self.shape[a + 1:])

    @property
    def local_bytes(self) -> int:
        return prod(self.local_shape) * self.itemsize

    def section_start(self, i: int) -> int:
        """Local index along the shard axis where section i starts on every rank."""
        return sum(s.local_units(self.tp) * s.unit_width for s in self.sections[:i])

    def held(self, i: int, rank: int) -> tuple[int, int]:
        return held_units(self.sections[i].units, self.tp, rank)

    def describe(self) -> dict:
        """Plain dict (msgpack-ready) a peer compares against its own derivation."""
        return {"shape": list(self.local_shape), "axis": self.shard_axis,
                "units": [s.units for s in self.sections],
                "local": [s.local_units(self.tp) for s in self.sections],
                "itemsize": self.itemsize}


def state_shard(spec: StateTensorSpec, tp: int, itemsize: int) -> TensorShard:
    names = spec.section_names or tuple(f"s{i}" for i in range(len(spec.widths)))
    secs = []
    for name, w, u in zip(names, spec.widths, spec.units, strict=True):
        if u % tp and tp % u:
            raise ConfigError(
                f"state tensor {spec.name!r} section {name}: {u} units cannot be split over "
                f"tensor_parallel_size={tp} (sizes that would divide: {_fits([u])})")
        secs.append(SectionShard(name, u, w // u))
    return TensorShard(spec.name, tuple(spec.shape), spec.shard_axis, tuple(secs), tp, itemsize)


def kv_shard(num_kv_heads: int, head_dim: int, tokens_per_block: int, tp: int,
             itemsize: int) -> TensorShard:
    """One KV block [2, tpb, kv_heads, head_dim], sharded by KV head."""
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ConfigError(f"num_key_value_heads={num_kv_heads} cannot be split over "
                          f"tensor_parallel_size={tp} (sizes that would divide: "
                          f"{_fits([num_kv_heads])})")
    return TensorShard("kv", (2, tokens_per_block, num_kv_heads, head_dim), 2,
                       (SectionShard("heads", num_kv_heads, 1),), tp, itemsize)


def model_shards(cfg, tp: int, dtype: str, tokens_per_block: int,
                 kv_dtype: str | None = None) -> tuple[TensorShard, ...]:
    """KV (when the model has attention) then each declared state tensor, at TP `tp`.
    `kv_dtype`: KV's stored dtype where not `dtype` (an fp8 row is head_dim + 4 bytes: its
    values then its scale, so a rank's heads take their scales along)."""
    check_tp(cfg, tp)
    out = []
    if cfg.attention_layers:
        kv = kv_dtype or dtype
        row = cfg.head_dim + (4 if kv == "float8_e4m3fn" else 0)
        out.append(kv_shard(cfg.num_key_value_heads, row, tokens_per_block, tp,
                            DTYPE_BYTES[kv]))
    for t in cfg.state_tensors:
        out.append(state_shard(t, tp, DTYPE_BYTES[t.dtype or dtype]))
    return tuple(out)


def tp_rules(cfg) -> list[tuple[str, int, str]]:
    """(field, value, rule) the TP size must meet; rule "split" (a multiple of TP),
    "split_or_one" (or exactly 1: replicated), "split_or_replicate" (or TP a multiple)."""
    rules = [("vocab_size", cfg.vocab_size, "split"), ("hidden_size", cfg.hidden_size, "split")]
    if cfg.attention_layers:
        rules += [("num_attention_heads", cfg.num_attention_heads, "split"),
                  ("num_key_value_heads", cfg.num_key_value_heads, "split_or_replicate")]
    return rules + cfg.tp_rules()  # the family's own layers (its config says)


def _ok(value: int, rule: str, tp: int) -> bool:
    if value % tp == 0:
        return True
    return (rule == "split_or_one" and value == 1) or (
        rule == "split_or_replicate" and tp % value == 0)


def _fits(values: list[int], rules: tuple[str, ...] = ()) -> str:
    rules = rules or ("split_or_replicate",) * len(values)
    good = [t for t in range(1, 17)
            if all(_ok(v, r, t) for v, r in zip(values, rules, strict=True))]
    return ", ".join(map(str, good))


def check_tp(cfg, tp: int) -> None:
    """Refuse a TP size the model cannot be split over, naming the field and the value."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor_parallel_size={tp!r} must be a positive integer")
    rules = tp_rules(cfg)
    for field, value, rule in rules:
        if not _ok(value, rule, tp):
            need = {"split": f"a multiple of {tp}",
                    "split_or_one": f"a multiple of {tp} or 1 (replicated)",
                    "split_or_replicate": f"a multiple of {tp} or a divisor of it"}[rule]
            sizes = _fits([v for _, v, _ in rules], tuple(r for _, _, r in rules))
            raise ConfigError(
                f"tensor_parallel_size={tp}: {field}={value} must be {need} "
                f"(sizes that divide this model: {sizes})")
