"""Side-channel and notification messages: msgpack only, every field type-checked.

No pickle anywhere on the wire (pickle over ZeroMQ was a remote-code hole in
vLLM). `decode` turns anything malformed (truncated, oversized, wrong types,
unknown op) into a TransferError that a listener reports and survives.

With a cluster secret every side-channel message is sealed: `seal` appends an
HMAC-SHA256 of the encoded message under the side-channel key, `unseal` checks
and strips it (Unauthenticated if it does not verify), before anything is parsed.

    sender -> receiver   {"v": 1, "op": "hello", "fingerprint": {...}, "backend": "nixl"}
    receiver -> sender   {"v": 1, "op": "welcome", "layout": {...}, "fingerprint": {...},
                          "transport": {...}, "incarnation": "..."}
                          (transport: backend-specific; incarnation: random per receiver)
                     or  {"v": 1, "op": "refused", "error": "...", "field": "dtype"}
    sender -> receiver   {"v": 1, "op": "abort", "rid": "...", "error": "...",
                          "posted": [layers]}   (layers posted to this receiver: [] = none)
    sender -> receiver   {"v": 1, "op": "claim", "rid": "...", "slot": int | None,
                          "blocks": bytes, "cid": int, "src": int}
                          (asks to write the reservation: before any post; cid: the sender's
                          number for this claim, unique per sender)
    receiver -> sender   {"v": 1, "op": "grant", "rid": "...", "cid": int}    (write it now)
                     or  {"v": 1, "op": "deny", "rid": "...", "cid": int, "error": "..."}
                          (never write it; cid: the claim answered. An answer to a claim the
                          sender gave up on must not pass for one to its next claim of the
                          same request: the reservation may be gone by then)
    sender -> receiver   {"v": 1, "op": "posted", "rid": "..."}   (writes started: watch now)
    sender -> receiver   {"v": 1, "op": "sent", "rid": "...", "posted": [layers]}
                          (every write of the request completed on the sender: nothing more
                          comes from it; releases a quarantine once those layers landed)
    receiver -> sender   {"v": 1, "op": "bye"}                 (receiver closing)
    ucx data header      {"v": 1, "op": "ucx_data", "seq": int, "notif": bytes, "ranges": bytes}
    data notification    {"v": 1, "op": "landed", "rid": "...", "layers": [..],
                          "slot": int | None, "blocks": bytes,  (int32 dst block ids)
                          "src": int, "parts": [..]}  (the writer's TP rank; per layer, how
                          many writers it has on this receiver: tensor-parallel prefill
                          ranks each write their share, transfer/tp_route.py)
"""

from __future__ import annotations

import hashlib
import hmac

import msgpack
import numpy as np

from baton.errors import TransferError

VERSION = 1

SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"fingerprint": (dict,), "backend": (str,)},
    "welcome": {"layout": (dict,), "fingerprint": (dict,), "transport": (dict,),
                "incarnation": (str,)},
    "refused": {"error": (str,), "field": (str,)},
    "abort": {"rid": (str,), "error": (str,), "posted": (list,)},
    "claim": {"rid": (str,), "slot": (int, type(None)), "blocks": (bytes,), "cid": (int,),
              "src": (int,)},
    "grant": {"rid": (str,), "cid": (int,)},
    "posted": {"rid": (str,)},
    "sent": {"rid": (str,), "posted": (list,)},
    "deny": {"rid": (str,), "cid": (int,), "error": (str,)},
    "bye": {},
    "ucx_data": {"seq": (int,), "notif": (bytes,), "ranges": (bytes,)},
    "landed": {"rid": (str,), "layers": (list,), "slot": (int, type(None)), "blocks": (bytes,),
               "src": (int,), "parts": (list,)},
}


def encode(op: str, **fields) -> bytes:
    return msgpack.packb({"v": VERSION, "op": op, **fields}, use_bin_type=True)


def decode(data: object, max_bytes: int, ops: tuple[str, ...] | None = None) -> dict:
    """Parse one message; raise TransferError on anything that is not a known, typed op."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TransferError(f"message must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise TransferError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        msg = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise TransferError(f"message is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(msg, dict) or msg.get("v") != VERSION:
        raise TransferError(f"message must be a map with v={VERSION}")
    op = msg.get("op")
    if not isinstance(op, str) or op not in SCHEMAS or (ops is not None and op not in ops):
        raise TransferError(f"unexpected message op {op!r}; expected one of {ops or list(SCHEMAS)}")
    for key, types in SCHEMAS[op].items():
        v = msg.get(key, _MISSING)
        if v is _MISSING or not isinstance(v, types) or isinstance(v, bool):
            raise TransferError(f"message {op}.{key} is missing or malformed: {v!r}")
    return msg


MAC_BYTES = 32


class Unauthenticated(TransferError):
    """A sealed channel got a message without a valid MAC (wrong or no cluster secret)."""


def seal(data: bytes, key: bytes | None) -> bytes:
    """`data` + its MAC under `key`; unchanged when there is no key (no cluster secret)."""
    return data if key is None else data + hmac.new(key, data, hashlib.sha256).digest()


def unseal(data: object, key: bytes | None) -> bytes:
    """The message inside a sealed frame; Unauthenticated unless its MAC verifies."""
    if key is None:
        return data
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < MAC_BYTES:
        raise Unauthenticated("message carries no MAC")
    body, mac = bytes(data[:-MAC_BYTES]), bytes(data[-MAC_BYTES:])
    if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), mac):
        raise Unauthenticated("message MAC does not verify")
    return body


def landed(rid: str, layers, slot: int | None, blocks, src: int = 0, parts=None) -> bytes:
    """The completion notification a data transfer carries (after its bytes); `parts`: per
    layer, the writers that layer has on the receiver (None: 1 each)."""
    layers = [int(g) for g in layers]
    parts = [1] * len(layers) if parts is None else [int(k) for k in parts]
    return encode("landed", rid=rid, layers=layers, slot=slot,
                  blocks=np.asarray(blocks, dtype="<i4").tobytes(), src=int(src), parts=parts)


def claim(rid: str, slot: int | None, blocks, cid: int = 0, src: int = 0) -> bytes:
    """A sender asks to write the reservation it was given (checked like `landed`); its
    answer names `cid`; `src`: the writer's TP rank (what its `landed` will name)."""
    return encode("claim", rid=rid, slot=slot, blocks=np.asarray(blocks, dtype="<i4").tobytes(),
                  cid=cid, src=int(src))


def landed_blocks(msg: dict) -> np.ndarray:
    b = msg["blocks"]
    if len(b) % 4:
        raise TransferError("landed.blocks is not a whole number of int32 ids")
    if not all(isinstance(g, int) and not isinstance(g, bool) for g in msg.get("layers", ())):
        raise TransferError("landed.layers must be integers")
    parts = msg.get("parts", [1] * len(msg.get("layers", ())))
    if len(parts) != len(msg.get("layers", ())) or not all(
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 1024 for k in parts):
        raise TransferError("landed.parts must be one writer count (1..1024) per layer")
    return np.frombuffer(b, dtype="<i4")


class _Missing:
    pass


_MISSING = _Missing()
