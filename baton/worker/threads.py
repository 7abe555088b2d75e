"""A process's threads, told apart from the idle threads its pools keep.

Thread pools (the gRPC servers', the router's HTTP requests') start threads on demand, up to
their size, and keep them. A thread that a request leaked is any other thread, or a pool
thread that never returns to its pool: `busy` (every thread but the idle pool threads) is
back at its resting value once the requests ended, however far the pools grew meanwhile.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import thread as _pool
from typing import NamedTuple

_IDLE = getattr(_pool, "_worker", None)
"""The loop of a ThreadPoolExecutor thread: its innermost frame while it waits for work."""


class ThreadCensus(NamedTuple):
    total: int
    idle_pool: int
    """Pool threads waiting for work."""

    @property
    def busy(self) -> int:
        return self.total - self.idle_pool


def thread_census() -> ThreadCensus:
    frames = sys._current_frames()
    idle = 0 if _IDLE is None else sum(
        1 for t in threading.enumerate()
        if (f := frames.get(t.ident)) is not None and f.f_code is _IDLE.__code__)
    return ThreadCensus(threading.active_count(), idle)
