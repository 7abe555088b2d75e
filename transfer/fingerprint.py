"""Compatibility fingerprint: the facts both peers must share before any byte moves.

Stage-independent (computed from the model and the cache settings, not from one
stage's pools), so an attention-free prefill stage and a full decode stage of
the same model agree. Checked on both sides of the handshake; a mismatch names
the first differing field in `FIELDS` order (most specific first).

Tensor parallelism: `tp_units` (the shardable units of every cache tensor's sections: KV
heads, Mamba2 heads / groups) must be equal; `tp_size` is the side's TP size and
`tp_layout` what each of its ranks holds ([lo, hi) units per section per rank), `tp_rank`
the rank whose pools this side's endpoint holds (checked against the reservation). A peer's
`tp_layout` is re-derived from the shared units and its `tp_size` and must match exactly
(a peer that shards KV heads by modulo, or scales replicated B/C, is refused before any
byte moves). Different TP sizes on the two sides pass only with `hetero_tp=True` (the
tensor-parallel plan, `transfer.tp_plan`); the per-stage planner needs them equal.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from baton.errors import ConfigError, TransferError
from baton.model.pools import FP8, PoolSpec
from baton.model.tp_shard import held_units

HEAD_FIELDS = ("dtype", "tokens_per_block", "num_layers", "pattern", "kv_block_bytes")
"""Compared first, in this order; then the state tensors' fields (`state_fields`), then
`model` (a hash of every model field) last, as the catch-all."""
TP_FIELDS = ("tp_size", "tp_layout", "tp_rank")
"""Not compared for equality: checked by `_tp_mismatch`."""


def compute_fingerprint(model, spec: PoolSpec, tp_size: int = 1, tp_rank: int = 0,
                        weight_format: str | None = None,
                        cache_format: str | None = None) -> dict:
    """Plain dict (msgpack-ready) describing what a cache built for `model`/`spec` holds.

    Per declared state tensor t: `t_sections` (only when it has more than one section: e.g.
    conv [x | B | C]), `t_shape` and `t_dtype`, so a mismatch names the tensor and what
    differs. `state_tensors` lists the names, in order. `cache_format` (`CacheConfig.
    cache_format`: state dtypes, rounding and seed, KV dtype) is declared, like
    `weight_format`, by the endpoints that build the engine.
    """
    has_attn = bool(model.attention_layers)
    kv = spec.kv_store_dtype  # the stored KV's real bytes (fp8 rows carry their scale)
    row = model.head_dim + (4 if kv == FP8 else 0)
    kv_bytes = 2 * spec.tokens_per_block * model.num_key_value_heads * row * kv.itemsize
    out = {
        "dtype": str(spec.dtype).removeprefix("torch."),
        "tokens_per_block": spec.tokens_per_block,
        "num_layers": model.num_layers,
        "pattern": model.pattern,
        "kv_block_bytes": kv_bytes if has_attn else 0,
        "state_tensors": [t.name for t in model.state_tensors],
    }
    for t in model.state_tensors:
        if len(t.widths) > 1:
            out[f"{t.name}_sections"] = list(t.widths)
    for t in model.state_tensors:
        out[f"{t.name}_shape"] = list(t.shape)
        out[f"{t.name}_dtype"] = t.dtype or "model"
    out["tp_units"] = tp_units(model)
    out["tp_size"] = tp_size
    out["tp_layout"] = tp_layout(out["tp_units"], tp_size)
    out["tp_rank"] = tp_rank  # which shard this side's pools hold (a decode rank's place)
    if weight_format is not None:  # fp8 and bf16 releases of one model compute differently
        out["weight_format"] = weight_format
    if cache_format is not None:  # bf16 state with other rounding draws other bits
        out["cache_format"] = cache_format
    out["model"] = model_hash(model)
    return out


def tp_units(model) -> dict:
    """Shardable units per section of every cache tensor (TP-invariant)."""
    units = {"kv": [model.num_key_value_heads]} if model.attention_layers else {}
    for t in model.state_tensors:
        units[t.name] = list(t.units)
    return units


def tp_layout(units: dict, tp: int) -> dict:
    """{tensor: [[[lo, hi] per section] per rank]}: the units each rank holds."""
    return {name: [[list(held_units(u, tp, r)) for u in us] for r in range(tp)]
            for name, us in units.items()}


def fields_of(fp: dict) -> tuple[str, ...]:
    """The fields of a fingerprint in comparison order."""
    state = [k for k in fp if k not in HEAD_FIELDS and k not in TP_FIELDS
             and k not in ("model", "weight_format", "cache_format")]
    order = {"_sections": 0, "_shape": 1, "_dtype": 2}
    state.sort(key=lambda k: (0, 0) if k == "state_tensors" else
               (1, next((v for suf, v in order.items() if k.endswith(suf)), 3)))
    return (*HEAD_FIELDS, *state, "cache_format", "weight_format", "model")


def model_hash(model) -> str:
    """Hash of every modelled field (the raw config.json is left out)."""
    d = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.name != "raw"}
    d["family"] = model.family
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def mismatch(local: dict, peer: object,
             hetero_tp: bool = False) -> tuple[str, object, object] | None:
    """(field, local value, peer value) of the first difference, or None if compatible."""
    if not isinstance(peer, dict):
        return ("fingerprint", "a map", type(peer).__name__)
    names = list(fields_of(local))
    names += [k for k in fields_of(peer) if k not in names]
    for f in names:
        a, b = local.get(f), peer.get(f)
        if f in ("weight_format", "cache_format") and (a is None or b is None):
            continue  # declared by the endpoints that load the model (not every TP / PP rank's)
        if _norm(a) != _norm(b):
            return (f, a, b)
    return _tp_mismatch(local, peer, hetero_tp)


def _tp_mismatch(local: dict, peer: dict, hetero_tp: bool):
    """Each side's declared layout is what its TP size gives under the shared units."""
    units = local.get("tp_units")
    if units is None:
        return None
    for fp_ in (local, peer):
        tp = fp_.get("tp_size")
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 1024:
            return ("tp_size", local.get("tp_size"), tp)
        try:
            want = tp_layout(units, tp)
        except ConfigError:
            return ("tp_size", local.get("tp_size"), tp)
        got = fp_.get("tp_layout")
        if not isinstance(got, dict) or {k: _deep(v) for k, v in got.items()} != want:
            bad = next((k for k in want if not isinstance(got, dict)
                        or _deep(got.get(k)) != want[k]), "tp_layout")
            return (f"tp_layout.{bad}", _deep(local.get("tp_layout", {}).get(bad)),
                    _deep(got.get(bad)) if isinstance(got, dict) else got)
    rank = peer.get("tp_rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < peer["tp_size"]:
        return ("tp_rank", local.get("tp_rank", 0), rank)
    if not hetero_tp and local["tp_size"] != peer["tp_size"]:
        return ("tp_size", local["tp_size"], peer["tp_size"])
    return None


def _deep(v: object) -> object:
    return [_deep(x) for x in v] if isinstance(v, (list, tuple)) else v


def check(local: dict, peer: object, who: str = "peer", hetero_tp: bool = False) -> None:
    """Raise TransferError naming the field when `peer` is incompatible with `local`."""
    diff = mismatch(local, peer, hetero_tp)
    if diff is not None:
        f, a, b = diff
        raise TransferError(
            f"incompatible {who}: fingerprint field '{f}' differs (local {a!r}, {who} {b!r}); "
            "prefill and decode must run the same model, dtype and cache settings")


def _norm(v: object) -> object:
    return list(v) if isinstance(v, tuple) else v
