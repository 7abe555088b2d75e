"""A per-request cancellation flag that also cancels whichever worker call is in flight.

`cancel()`: the client gave up (disconnected, deadline): the request just ends.
`stop()`:   the client ended the answer itself (the HTTP API's stop strings): the workers are
            cancelled all the same, but the stream still ends with the request's summary
            (finish_reason STOP), as an answer ended by max_tokens or EOS does.
`stop_sample(i)`: the same for one sample of a request with n > 1; its siblings go on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Cancellation:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._stopped = False
        self._hooks: list[Callable[[], None]] = []
        self._samples: set[int] = set()
        self._sample_hooks: list[Callable[[int], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def stopped(self) -> bool:
        """Cancelled by `stop()`: the answer is whole and its summary is still wanted."""
        return self._stopped

    def cancel(self) -> None:
        self._end(stopped=False)

    def stop(self) -> None:
        """Ends the request as complete (no-op once cancelled: nobody waits for a summary)."""
        self._end(stopped=True)

    def stop_sample(self, sample: int) -> None:
        """Ends one sample's answer as complete (n > 1): its summary is still wanted."""
        with self._lock:
            if self._cancelled or sample in self._samples:
                return
            self._samples.add(sample)
            hooks = list(self._sample_hooks)
        for hook in hooks:
            hook(sample)

    @property
    def stopped_samples(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._samples)

    @contextmanager
    def sample_hook(self, on_stop: Callable[[int], None]) -> Iterator[None]:
        """Runs `on_stop(sample)` for each sample stopped inside the block (at once for those
        stopped before it)."""
        with self._lock:
            already = sorted(self._samples)
            self._sample_hooks.append(on_stop)
        for sample in already:
            on_stop(sample)
        try:
            yield
        finally:
            with self._lock:
                self._sample_hooks.remove(on_stop)

    def _end(self, stopped: bool) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._stopped = stopped  # set before anyone can see `cancelled`
            self._cancelled = True
            hooks = list(self._hooks)
        for hook in hooks:
            hook()

    @contextmanager
    def hook(self, on_cancel: Callable[[], None]) -> Iterator[None]:
        """Runs `on_cancel` if the request is cancelled inside the block (at once if it was)."""
        with self._lock:
            already = self._cancelled
            if not already:
                self._hooks.append(on_cancel)
        if already:
            on_cancel()
        try:
            yield
        finally:
            with self._lock:
                if on_cancel in self._hooks:
                    self._hooks.remove(on_cancel)
