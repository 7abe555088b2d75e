"""Hypothesis strategies for hostile inputs: protobuf messages with hostile field values, raw
mutated bytes, JSON bodies and side-channel frames, and the status classes a server may answer.

A bad input must get a client-error status (gRPC INVALID_ARGUMENT, UNAUTHENTICATED, ... or HTTP
4xx): never INTERNAL / UNKNOWN / UNAVAILABLE (5xx), which say the server broke or tell clients
to retry something that can never work.
"""

from __future__ import annotations

import random
import struct

import grpc
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

CLIENT_ERRORS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
})
"""The 4xx class of gRPC statuses: what a bad request may be answered with."""


def fuzz_settings(n: int) -> settings:
    """`n` cases, reproducible in CI (derandomized, no example database), no per-case
    deadline, no shrinking unless a case fails."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink),
                    suppress_health_check=list(HealthCheck), print_blob=True)


INT32 = (-2**31, 2**31 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)


EDGE_STRINGS = ("", "req-1", "\x00", "\u202e\u0000\uffff", "../../etc/passwd", "%s%n{0}",
                "a" * 5000, "\U0001f600" * 3000, " " * 70_000, "\u00e9" * 300, "tiny")
EDGE_FLOATS = (0.0, -0.0, 1.0, -1.0, 1e-38, 1e-45, 1e-300, 1e38, 3.4e38, 1e300, float("nan"),
               float("inf"), float("-inf"), 2.0, 0.5)


class Hostile:
    """Hostile values from one seeded `random.Random`: edges of every type (0, -1, the limits,
    NaN, infinities), unicode of every plane, empty and very long strings, nested JSON.

    Hypothesis draws the seed (and the case's kind); the bulk of a case comes from here, so a
    case costs two draws instead of hundreds and thousands of cases fit in seconds. Cases stay
    reproducible: derandomized seeds, and a failure prints the seed."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def chance(self, p: float = 0.5) -> bool:
        return self.rng.random() < p

    def int(self, lo: int, hi: int) -> int:
        r = self.rng
        if r.random() < 0.6:
            edges = [v for v in (0, 1, 2, 3, 7, 255, 256, 257, 4095, 65535, -1, -2, lo, hi,
                                 lo + 1, hi - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1)
                     if lo <= v <= hi]
            return r.choice(edges)
        return r.randint(lo, hi) if r.random() < 0.5 else r.randint(max(lo, 0), min(hi, 300))

    def float(self) -> float:
        r = self.rng
        if r.random() < 0.6:
            return r.choice(EDGE_FLOATS)
        return struct.unpack("<f", r.randbytes(4))[0] if r.random() < 0.5 else r.uniform(-4, 4)

    def text(self, max_size: int = 12) -> str:
        r = self.rng
        if r.random() < 0.3:
            return r.choice(EDGE_STRINGS)
        planes = r.choice([(32, 127), (0, 32), (128, 0x800), (0x800, 0xD800), (0xE000, 0x110000)])
        return "".join(chr(r.randrange(*planes)) for _ in range(r.randrange(max_size + 1)))

    def ids(self, vocab: int, max_len: int) -> list[int]:
        """Prompts: empty, in the vocabulary, past it, negative, int32 edges, far too long."""
        r = self.rng
        n = r.choice([0, 1, 2, r.randrange(max_len + 8), max_len, max_len + 1, 5000])
        kind = r.randrange(4)
        if kind == 0:
            return [r.randrange(3, vocab) for _ in range(n)]
        pool = [0, 1, 2, vocab - 1, vocab, vocab + 1, -1, -2**31, 2**31 - 1]
        return [r.choice(pool) if kind == 1 or r.random() < 0.2 else
                r.randrange(-2**31, 2**31) for _ in range(n)]

    def json(self, depth: int = 2, binary: bool = False) -> object:
        """Any JSON value (`binary`: msgpack's, with bytes and 64-bit integers)."""
        r = self.rng
        kind = r.randrange(8 if depth > 0 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return r.random() < 0.5
        if kind == 2:
            return self.int(-2**63, 2**64 - 1) if binary else self.int(-2**70, 2**70)
        if kind == 3:
            x = self.float()
            return x if binary or x == x and abs(x) != float("inf") else 0.5
        if kind == 4:
            return self.text()
        if kind == 5:
            return r.randbytes(r.randrange(16)) if binary else self.text(3)
        if kind == 6:
            return [self.json(depth - 1, binary) for _ in range(r.randrange(4))]
        return {self.text(6): self.json(depth - 1, binary) for _ in range(r.randrange(4))}

    def mutate(self, data: bytes) -> bytes:
        """`data` with bytes flipped, inserted, deleted or truncated; or random bytes."""
        r = self.rng
        out = bytearray(data)
        kind = r.randrange(5)
        if kind == 4 or not out:
            return r.randbytes(r.randrange(64))
        if kind == 3:
            return bytes(out[:r.randrange(len(out))])
        for _ in range(r.randint(1, 4)):
            at = r.randrange(len(out) + 1)
            if kind == 0 and at < len(out):
                out[at] ^= r.randrange(1, 256)
            elif kind == 1:
                out[at:at] = r.randbytes(r.randint(1, 8))
            else:
                del out[at:at + r.randint(1, 8)]
        return bytes(out)


def cases(build, kinds: tuple[str, ...]) -> st.SearchStrategy:
    """`build(kind, Hostile)` for a drawn kind and seed."""
    return st.tuples(st.sampled_from(kinds), st.integers(0, 2**32 - 1)).map(
        lambda ks: build(ks[0], Hostile(ks[1])))
