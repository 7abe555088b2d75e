"""Counters of one tier (disk or shared store), reported in Stats and /metrics."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TierCounters:
    hits: int = 0
    """Admissions whose prefix came back from this tier."""
    hit_tokens: int = 0
    """Prompt tokens those hits restored."""
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0
    """Time spent reading and restoring hits (latency = load_seconds / hits)."""
    admitted: int = 0
    """Entries written (evicted from the pool, or pushed to the shared store)."""
    evicted: int = 0
    """Entries removed for room (the tier's own eviction policy)."""
    rejected: int = 0
    """Entries not admitted: larger than the tier."""
    corrupt: int = 0
    """Entries that failed a check (checksum, truncation, missing state): removed, a miss."""
    errors: int = 0
    """Reads or writes that failed (I/O error, store unreachable): each a miss."""
    removed_tmp: int = 0
    """Half-written files of dead writers removed at start."""

    def as_dict(self) -> dict:
        return asdict(self)
