"""A per-request cancellation flag that also cancels whichever worker call is in flight."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Cancellation:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._hooks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled:
                return
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
