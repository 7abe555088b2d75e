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
from baton.model.config import ModelConfig
from baton.model.pools import PoolSpec

FIELDS = ("dtype", "tokens_per_block", "num_layers", "pattern", "kv_block_bytes",
          "conv_sections", "conv_shape", "ssm_shape", "model")
"""Compared in this order; `model` (a hash of every model field) last, as the catch-all."""


def compute_fingerprint(model: ModelConfig, spec: PoolSpec) -> dict:
    """Plain dict (msgpack-ready) describing what a cache built for `model`/`spec` holds."""
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    has_attn = bool(model.attention_layers)
    kv_bytes = 2 * spec.tokens_per_block * model.num_key_value_heads * model.head_dim * itemsize
    return {
        "dtype": str(spec.dtype).removeprefix("torch."),
        "tokens_per_block": spec.tokens_per_block,
        "num_layers": model.num_layers,
        "pattern": model.pattern,
        "kv_block_bytes": kv_bytes if has_attn else 0,
        "conv_sections": list(model.conv_sections),
        "conv_shape": [model.conv_dim, model.conv_kernel - 1],
        "ssm_shape": [model.mamba_num_heads, model.mamba_head_dim, model.ssm_state_size],
        "model": model_hash(model),
    }


def model_hash(model: ModelConfig) -> str:
    """Hash of every modelled field (the raw config.json is left out)."""
    d = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.name != "raw"}
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def mismatch(local: dict, peer: object) -> tuple[str, object, object] | None:
    """(field, local value, peer value) of the first difference, or None if compatible."""
    if not isinstance(peer, dict):
        return ("fingerprint", "a map", type(peer).__name__)
    for f in FIELDS:
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
