"""Compatibility fingerprint: the facts both peers must share before any byte moves.

Stage-independent (computed from the model and the cache settings, not from one
stage's pools), so an attention-free prefill stage and a full decode stage of
the same model agree. Checked on both sides of the handshake; a mismatch names
the first differing field in `FIELDS` order (most specific first).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from baton.errors import TransferError
from baton.model.pools import PoolSpec

HEAD_FIELDS = ("dtype", "tokens_per_block", "num_layers", "pattern", "kv_block_bytes")
"""Compared first, in this order; then the state tensors' fields (`state_fields`), then
`model` (a hash of every model field) last, as the catch-all."""


def compute_fingerprint(model, spec: PoolSpec) -> dict:
    """Plain dict (msgpack-ready) describing what a cache built for `model`/`spec` holds.

    Per declared state tensor t: `t_sections` (only when it has more than one section: e.g.
    conv [x | B | C]), `t_shape` and `t_dtype`, so a mismatch names the tensor and what
    differs. `state_tensors` lists the names, in order.
    """
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    has_attn = bool(model.attention_layers)
    kv_bytes = 2 * spec.tokens_per_block * model.num_key_value_heads * model.head_dim * itemsize
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
    out["model"] = model_hash(model)
    return out


def fields_of(fp: dict) -> tuple[str, ...]:
    """The fields of a fingerprint in comparison order."""
    state = [k for k in fp if k not in HEAD_FIELDS and k != "model"]
    order = {"_sections": 0, "_shape": 1, "_dtype": 2}
    state.sort(key=lambda k: (0, 0) if k == "state_tensors" else
               (1, next((v for suf, v in order.items() if k.endswith(suf)), 3)))
    return (*HEAD_FIELDS, *state, "model")


def model_hash(model) -> str:
    """Hash of every modelled field (the raw config.json is left out)."""
    d = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.name != "raw"}
    d["family"] = model.family
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def mismatch(local: dict, peer: object) -> tuple[str, object, object] | None:
    """(field, local value, peer value) of the first difference, or None if compatible."""
    if not isinstance(peer, dict):
        return ("fingerprint", "a map", type(peer).__name__)
    names = list(fields_of(local))
    names += [k for k in fields_of(peer) if k not in names]
    for f in names:
        a, b = local.get(f), peer.get(f)
        if _norm(a) != _norm(b):
            return (f, a, b)
    return None


def check(local: dict, peer: object, who: str = "peer") -> None:
    """Raise TransferError naming the field when `peer` is incompatible with `local`."""
    diff = mismatch(local, peer)
    if diff is not None:
        f, a, b = diff
        raise TransferError(
            f"incompatible {who}: fingerprint field '{f}' differs (local {a!r}, {who} {b!r}); "
            "prefill and decode must run the same model, dtype and cache settings")


def _norm(v: object) -> object:
    return list(v) if isinstance(v, tuple) else v
