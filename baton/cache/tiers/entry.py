"""One tier entry: a snapshot with the KV of its whole path, self-describing and checksummed.

    offset 0   magic     b"BATONSN\\x01"                            8 bytes
           8   hlen      header length, u32 LE
          12   hcrc      CRC-32 of the header, u32 LE
          16   header    JSON: fmt, n (tokens), tpb, sections' byte counts, crc, flops, mac
      16+hlen  payload   tokens (int32 LE, n of them) | KV | state

KV: `kv[:, blocks]` of the pool (every attention layer, ceil(n / tpb) blocks, the last one a
partial page when n is not block-aligned); state: every state tensor's slot, in declared
order. An entry is a hit only if every check passes: magic, header CRC, the format (model and
layouts) equal to the reader's, the exact byte counts this format needs for n tokens (so an
entry whose state is missing, LMCache's failure on hybrids, is a miss, never KV-only reuse),
the payload CRC, the MAC (HMAC-SHA256 over the header's other fields and the payload, keyed
by the cluster secret: an entry some other writer put in a shared folder or store is a miss),
and tokens equal to the prompt's first n.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import zlib
from dataclasses import dataclass, replace

import torch

from baton.model.pools import Pools

MAGIC = b"BATONSN\x01"
PREFIX = struct.Struct("<8sII")


class BadEntry(Exception):
    """An entry that must not be used (the message says which check failed)."""


@dataclass(frozen=True)
class Header:
    fmt: str
    n: int
    tpb: int
    tokens: int
    kv: int
    state: int
    crc: int
    flops: float = 0.0
    bh: int = 0
    """The contract's block_hash of the entry's full blocks (for router events)."""
    mac: str = ""
    """HMAC-SHA256 (hex) of the other fields and the payload under the tier key."""

    @property
    def payload_bytes(self) -> int:
        return self.tokens + self.kv + self.state

    def encode(self) -> bytes:
        body = json.dumps(self.__dict__, sort_keys=True).encode()
        return PREFIX.pack(MAGIC, len(body), zlib.crc32(body)) + body


class Layout:
    """How one worker's pools turn into entry bytes and back; `fmt` names everything a reader
    must share (model identity, dtypes, shapes, layer ids) so another layout never matches."""

    def __init__(self, pools: Pools, model_id: str, key: bytes = b""):
        self.pools = pools
        self._key = key or b"baton/tier-entry/no-cluster-secret"
        """The entries' MAC key (the cluster secret's "cache-tier" key; without a secret a
        fixed one: corruption is still caught, authorship is not)."""
        s = pools.spec
        self.tpb = s.tokens_per_block
        self.kv_block_bytes = (len(s.attn_layers) * pools.kv[0, 0].numel()
                               * pools.kv.element_size()) if pools.has_kv else 0
        # a snapshot's state, in its stored dtype (16-bit snapshot slots: PoolSpec.snapshot_slots)
        self.state_bytes = s.snapshot_bytes_per_slot() if pools.has_state else 0
        self._stored = {t.name: s.snapshot_dtype(t) for t in s.state_tensors}
        desc = {
            "model": model_id, "dtype": str(s.dtype), "tpb": s.tokens_per_block,
            "attn": list(s.attn_layers), "state": list(s.state_layers),
            "kv": [s.num_kv_heads, s.head_dim],
            "tensors": [[t.name, list(t.shape), str(s.snapshot_dtype(t))]
                        for t in s.state_tensors],
        }
        raw = json.dumps(desc, sort_keys=True).encode()
        self.fmt = zlib.crc32(raw).to_bytes(4, "little").hex() + f"{len(raw):04x}"

    def kv_bytes(self, n: int) -> int:
        return -(-n // self.tpb) * self.kv_block_bytes

    def entry_bytes(self, n: int) -> int:
        """An upper bound of an entry's size for n tokens (headers are under 512 bytes)."""
        return 512 + 4 * n + self.kv_bytes(n) + self.state_bytes

    def gather(self, tokens: list[int], blocks: list[int], slot: int,
               flops: float = 0.0, bh: int = 0) -> tuple[Header, torch.Tensor]:
        """Copy a snapshot out of the pools: its header and payload (one uint8 tensor)."""
        payload = self.copy_out(tokens, blocks, slot)
        return self.seal(len(tokens), payload, flops, bh), payload

    def copy_out(self, tokens: list[int], blocks: list[int], slot: int) -> torch.Tensor:
        """The payload of a snapshot still in the pools (the part that must happen before its
        blocks and slot are reused); `seal` adds the checksums, on any thread."""
        n = len(tokens)
        parts = [torch.tensor(tokens, dtype=torch.int32).view(torch.uint8)]
        # entries live in host memory: a GPU pool's bytes are copied down here
        if self.pools.has_kv:
            kv = self.pools.kv
            idx = torch.tensor(blocks[: -(-n // self.tpb)], dtype=torch.long, device=kv.device)
            parts.append(kv.index_select(1, idx).cpu().reshape(-1).view(torch.uint8))
        if self.pools.has_state:
            for name, dt in self._stored.items():
                v = self.pools.slot(name, slot).to(dt)
                parts.append(v.cpu().contiguous().reshape(-1).view(torch.uint8))
        return torch.cat(parts)

    def seal(self, n: int, payload: torch.Tensor, flops: float = 0.0, bh: int = 0) -> Header:
        """The header of a payload `copy_out` made: byte counts, CRC-32 and MAC."""
        crc = zlib.crc32(payload.numpy())
        kv = self.kv_bytes(n)
        h = Header(self.fmt, n, self.tpb, 4 * n, kv, self.state_bytes, crc, flops, bh)
        return replace(h, mac=self.mac(h, payload))

    def mac(self, h: Header, payload: torch.Tensor) -> str:
        fields = {k: v for k, v in h.__dict__.items() if k != "mac"}
        m = hmac.new(self._key, json.dumps(fields, sort_keys=True).encode(), hashlib.sha256)
        m.update(memoryview(payload.numpy()))
        return m.hexdigest()

    def check_header(self, h: Header) -> None:
        """BadEntry unless `h` describes a complete entry of this layout."""
        if h.fmt != self.fmt or h.tpb != self.tpb:
            raise BadEntry(f"format {h.fmt} (tpb {h.tpb}) is not this worker's {self.fmt}")
        if h.state != self.state_bytes:
            raise BadEntry(f"state section has {h.state} bytes, not {self.state_bytes}: "
                           "KV without its state is never a hit")
        if h.kv != self.kv_bytes(h.n) or h.tokens != 4 * h.n or h.n < 1:
            raise BadEntry(f"sections ({h.tokens}, {h.kv}) do not fit {h.n} tokens")

    def check_payload(self, h: Header, payload: torch.Tensor, tokens: list[int]) -> None:
        if payload.numel() != h.payload_bytes:
            raise BadEntry(f"payload has {payload.numel()} bytes, header says {h.payload_bytes}")
        if zlib.crc32(payload.numpy()) != h.crc:
            raise BadEntry("payload checksum does not match")
        if not hmac.compare_digest(self.mac(h, payload), h.mac):
            raise BadEntry("entry's MAC does not match: not written under this cluster's secret")
        got = payload[: h.tokens].view(torch.int32).tolist()
        if got != list(tokens[: h.n]):
            raise BadEntry("entry's tokens are not the prompt's")

    def scatter(self, h: Header, payload: torch.Tensor, blocks: list[int],
                first: int, slot: int) -> None:
        """Write the entry's KV blocks `first..` into pool `blocks` (one per block from
        `first` on) and its state into `slot`."""
        off = h.tokens
        if self.pools.has_kv:
            kv = self.pools.kv.view(torch.uint8)  # as bytes: torch copies no fp8 by index
            shape = (kv.shape[0], -(-h.n // self.tpb), *kv.shape[2:])
            src = payload[off : off + h.kv].view(shape)
            if blocks:
                idx = torch.tensor(blocks, dtype=torch.long, device=kv.device)
                kv.index_copy_(1, idx, src[:, first : first + len(blocks)].to(kv.device))
            off += h.kv
        if self.pools.has_state:
            for name, dt in self._stored.items():
                t = self.pools.slot(name, slot)
                nb = t.numel() * dt.itemsize
                t.copy_(payload[off : off + nb].view(dt).view(t.shape))
                # (copy_ moves host bytes onto a GPU pool's device)
                off += nb


def decode_prefix(raw: bytes) -> tuple[int, int]:
    """(header length, header crc) from an entry's first 16 bytes; BadEntry if not an entry."""
    if len(raw) < PREFIX.size:
        raise BadEntry("shorter than an entry's prefix")
    magic, hlen, hcrc = PREFIX.unpack(raw[: PREFIX.size])
    if magic != MAGIC:
        raise BadEntry("no entry magic")
    if not 0 < hlen < 1 << 16:
        raise BadEntry(f"header length {hlen} is out of range")
    return hlen, hcrc


def decode_header(body: bytes, hcrc: int) -> Header:
    if zlib.crc32(body) != hcrc:
        raise BadEntry("header checksum does not match")
    try:
        return Header(**json.loads(body))
    except (ValueError, TypeError) as e:
        raise BadEntry(f"header is not an entry header: {e}") from None


def split(blob: bytes | bytearray | memoryview) -> tuple[Header, torch.Tensor]:
    """An entry held in one buffer (the shared store's value) -> header, payload."""
    hlen, hcrc = decode_prefix(bytes(blob[: PREFIX.size]))
    h = decode_header(bytes(blob[PREFIX.size : PREFIX.size + hlen]), hcrc)
    payload = torch.frombuffer(bytearray(blob[PREFIX.size + hlen :]), dtype=torch.uint8) \
        if len(blob) > PREFIX.size + hlen else torch.empty(0, dtype=torch.uint8)
    return h, payload
