"""The snapshot keys workers report and the prefix_aware policy matches (one definition for both).

A hybrid prefix is reusable only where a Mamba snapshot exists, so workers report
snapshots, not KV blocks. A snapshot after exactly `n` prompt tokens (block size `B`) is named
by two 64-bit keys:

    tokens   t0 ........ tB-1 | tB ...... t2B-1 | ... | tkB ... tn-1        k = n // B
             |--- block 1 ---|--- block 2 ----|     |- tail (n - kB) -|

    block_hash(0) = 0
    block_hash(i) = blake2b8( block_hash(i-1) as u64 LE || block i as int32 LE )
    snapshot_hash = blake2b8( b"S" || block_hash(k) as u64 LE || n as u64 LE || tail as int32 LE )

`blake2b8` is BLAKE2b with an 8-byte digest, read as an unsigned little-endian integer.
Token ids are signed 32-bit little-endian. The tail is empty for a block-aligned `n`
(then snapshot_hash still differs from block_hash because of the "S" tag and `n`).

The router indexes snapshots by `block_hash(k)` so that, for a prompt, it computes one
chained hash per full block and verifies only the snapshots stored under those nodes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

ROOT_HASH = 0
"""block_hash of the empty prefix."""


class SnapshotKey(NamedTuple):
    block_hash: int
    snapshot_hash: int
    num_tokens: int


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def block_hashes(tokens: Sequence[int], tokens_per_block: int) -> list[int]:
    """Chained hashes of the full blocks: element i is block_hash(i), element 0 is ROOT_HASH."""
    step = 4 * tokens_per_block
    data = _pack_tokens(tokens[: len(tokens) // tokens_per_block * tokens_per_block])
    out = [ROOT_HASH]
    h = ROOT_HASH
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    for off in range(0, len(data), step):
        digest = blake2b(h.to_bytes(8, "little") + data[off : off + step], digest_size=8).digest()
        h = from_bytes(digest, "little")
        out.append(h)
    return out


def tail_hash(
    block_hash: int, tokens: Sequence[int], num_tokens: int, tokens_per_block: int
) -> int:
    """snapshot_hash of `tokens[:num_tokens]`, given block_hash(num_tokens // tokens_per_block)."""
    tail = tokens[(num_tokens // tokens_per_block) * tokens_per_block : num_tokens]
    head = b"S" + block_hash.to_bytes(8, "little") + num_tokens.to_bytes(8, "little")
    return _digest(head + _pack_tokens(tail))


def snapshot_key(tokens: Sequence[int], num_tokens: int, tokens_per_block: int) -> SnapshotKey:
    """The keys a worker reports for a snapshot after `tokens[:num_tokens]`."""
    if not 0 < num_tokens <= len(tokens):
        raise ValueError(f"num_tokens must be in [1, {len(tokens)}], got {num_tokens}")
    k = num_tokens // tokens_per_block
    bh = block_hashes(tokens[: k * tokens_per_block], tokens_per_block)[-1]
    return SnapshotKey(bh, tail_hash(bh, tokens, num_tokens, tokens_per_block), num_tokens)
