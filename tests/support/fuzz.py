"""Hypothesis strategies for hostile inputs: protobuf messages with hostile field values, raw
mutated bytes, JSON bodies and side-channel frames, and the status classes a server may answer.

A bad input must get a client-error status (gRPC INVALID_ARGUMENT, UNAUTHENTICATED, ... or HTTP
4xx): never INTERNAL / UNKNOWN / UNAVAILABLE (5xx), which say the server broke or tell clients
to retry something that can never work.
"""

from __future__ import annotations

import random

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
                "a" * 5000, "\U0001f600" * 3000, " " * 70_000, "\udbff"[:0] + "\u00e9" * 300)


def hostile_int(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Mostly the edges (0, 1, -1, the type's limits, powers of two), some anything in range."""
    edges = sorted({v for v in (0, 1, 2, 3, 7, 255, 256, 257, 4095, 65535, -1, -2, lo, hi,
                                lo + 1, hi - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1)
                    if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def hostile_float(width: int = 32) -> st.SearchStrategy[float]:
    return st.one_of(
        st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-38, 1e-45, 1e38, 3.4e38, float("nan"),
                         float("inf"), float("-inf"), 2.0, 0.5]),
        st.floats(width=width, allow_nan=True, allow_infinity=True),
    )


def hostile_text(max_size: int = 12) -> st.SearchStrategy[str]:
    """Empty, unicode of every plane, control characters, and a few very long strings."""
    return st.one_of(st.sampled_from(EDGE_STRINGS), st.text(max_size=max_size))


def seeded(make) -> st.SearchStrategy:
    """`make(random.Random)`'s value for a drawn seed: bulk content (long id lists, byte
    mutations) costs one draw instead of one per element, which keeps thousands of cases
    within seconds; the cases stay reproducible (derandomized seeds)."""
    return st.integers(0, 2**32 - 1).map(lambda seed: make(random.Random(seed)))


def token_ids(vocab: int, max_len: int) -> st.SearchStrategy[list[int]]:
    """Prompts: empty, in the vocabulary, past it, negative, int32 edges, far too long."""
    def make(rng: random.Random) -> list[int]:
        n = rng.choice([0, 1, 2, rng.randrange(max_len + 8), max_len, max_len + 1, 5000])
        kind = rng.randrange(4)
        if kind == 0:
            return [rng.randrange(3, vocab) for _ in range(n)]
        pool = [0, 1, 2, vocab - 1, vocab, vocab + 1, -1, -2**31, 2**31 - 1]
        return [rng.choice(pool) if kind == 1 or rng.random() < 0.2 else
                rng.randrange(-2**31, 2**31) for _ in range(n)]
    return seeded(make)


def mutated(data: bytes) -> st.SearchStrategy[bytes]:
    """`data` with bytes flipped, inserted, deleted or truncated; or random bytes."""
    def make(rng: random.Random) -> bytes:
        out = bytearray(data)
        kind = rng.randrange(5)
        if kind == 4 or not out:
            return rng.randbytes(rng.randrange(64))
        if kind == 3:
            return bytes(out[:rng.randrange(len(out))])
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(out) + 1)
            if kind == 0 and at < len(out):
                out[at] ^= rng.randrange(1, 256)
            elif kind == 1:
                out[at:at] = rng.randbytes(rng.randint(1, 8))
            else:
                del out[at:at + rng.randint(1, 8)]
        return bytes(out)
    return seeded(make)


def json_values(max_leaves: int = 6) -> st.SearchStrategy[object]:
    """Any JSON value (nested lists and objects of hostile scalars)."""
    scalars = st.one_of(st.none(), st.booleans(), hostile_int(-2**70, 2**70),
                        st.floats(allow_nan=False, allow_infinity=False), hostile_text())
    return st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(hostile_text(6), inner, max_size=3)),
        max_leaves=max_leaves)
