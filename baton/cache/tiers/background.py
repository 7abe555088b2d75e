"""The tiers' I/O thread: entry writes and restore reads run here, off the engine thread.

One thread per worker's tiers, first in, first out: a read posted after a write of the same
entry finds it committed. Idle, it blocks on its queue (no polling); it starts on the first
job. A job that raises is logged and dropped: the tiers are an optimisation, and each job
reports its own failure to whoever waits for it (a read's future resolves to a miss).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("baton.cache.tiers")


class IOThread:
    def __init__(self, name: str = "baton-tier-io"):
        self.name = name
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queued = 0

    def post(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._queued += 1
        self._q.put(job)

    @property
    def queued(self) -> int:
        """Jobs posted and not finished."""
        return self._queued

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job posted so far has run; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Run what is queued, then stop the thread."""
        with self._lock:
            t = self._thread
        if t is None:
            return
        self._q.put(None)
        t.join(timeout)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                with self._lock:
                    self._thread = None
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - one failed job must not stop the others
                log.exception("tier I/O job failed; the entry it concerned is a miss")
            finally:
                with self._idle:
                    self._queued -= 1
                    self._idle.notify_all()
