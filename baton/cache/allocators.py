"""Id bookkeeping for the two pools: ref-counted KV blocks and exclusively owned state slots.

Both hand out the lowest-numbered free id first at start and then reuse ids in the order
they were freed (a FIFO queue), so tests can predict exact ids.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class BlockAllocator:
    """KV block ids with reference counts: a block is free exactly when its count is 0.

    Owners of a reference: a prefix-tree node (its block), a partial snapshot (its copied
    page) and each running request whose block table lists the block.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.on_free: Callable[[int], None] | None = None
        """Called with each block that becomes free (test canaries)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free block with one reference, or None when none is free."""
        if not self._free:
            return None
        b = self._free.popleft()
        self.ref[b] = 1
        return b

    def incref(self, b: int) -> None:
        assert self.ref[b] > 0, f"incref of free block {b}"
        self.ref[b] += 1

    def decref(self, b: int) -> bool:
        """Drop one reference; True when that freed the block."""
        assert self.ref[b] > 0, f"decref of free block {b}"
        self.ref[b] -= 1
        if self.ref[b]:
            return False
        self._free.append(b)
        if self.on_free is not None:
            self.on_free(b)
        return True

    def free_ids(self) -> list[int]:
        return list(self._free)


class SlotAllocator:
    """Recurrent state slot ids; each slot is owned by one request (live) or one snapshot.

    `snapshot_ids`: slots only snapshots take (a pool of their own in a narrower dtype,
    `PoolSpec.snapshot_slots`); without them a snapshot takes any of `range(num_slots)`."""

    def __init__(self, num_slots: int, snapshot_ids: range = range(0)):
        self.num_slots = num_slots
        """Slots a live request can take."""
        self.snapshot_ids = snapshot_ids
        self._free: deque[int] = deque(range(num_slots))
        self._snap_free: deque[int] = deque(snapshot_ids)
        self._used: set[int] = set()
        self.on_free: Callable[[int], None] | None = None
        """Called with each slot that becomes free (test canaries)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        s = self._free.popleft()
        self._used.add(s)
        return s

    def allocate_snapshot(self) -> int | None:
        """A slot for a snapshot: one of `snapshot_ids` when there are any."""
        if not self.snapshot_ids:
            return self.allocate()
        if not self._snap_free:
            return None
        s = self._snap_free.popleft()
        self._used.add(s)
        return s

    def release(self, s: int) -> None:
        assert s in self._used, f"release of slot {s}, which is not in use"
        self._used.remove(s)
        (self._snap_free if s in self.snapshot_ids else self._free).append(s)
        if self.on_free is not None:
            self.on_free(s)

    def free_ids(self) -> list[int]:
        return [*self._free, *self._snap_free]

    def ids(self) -> list[int]:
        """Every slot id, live-capable and snapshot-only."""
        return [*range(self.num_slots), *self.snapshot_ids]
