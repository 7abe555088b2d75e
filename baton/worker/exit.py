"""Ending a role process (router or worker) once it has stopped cleanly."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("baton.exit")

SLOW_STOP_S = 0.5
"""A stop phase that takes longer than this is logged."""

STOP_BUDGET_S = 2.5
"""All of a process's stop phases get this long; the process then exits without the rest (a
cluster stop kills what is still running 3 s after SIGTERM, and must end within 5 s)."""


class StopSignals:
    """SIGINT and SIGTERM for a role process's main thread, whichever thread the kernel hands
    them to. Python runs a signal's handler on the main thread only; a signal that lands on
    another thread (any of the gRPC, UCX or engine threads may take it) leaves a main thread
    blocked on a lock asleep for good, so `threading.Event().wait()` missed SIGTERM now and
    then and the cluster killed the worker 3 s later. Here the main thread blocks reading
    the signal wakeup pipe instead, which the C-level handler writes on whatever thread it
    ran. Create it (main thread) before the process says it is serving; `wait()` then."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
        self.signals = frozenset(int(s) for s in signals)
        self._read, self._write = os.pipe()  # open for the process's life
        os.set_blocking(self._write, False)
        for sig in self.signals:  # a Python handler, so the C one writes the pipe
            signal.signal(sig, _ignore)
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def wait(self) -> int:
        """Block until one of the signals arrives; returns its number. Later ones are ignored
        (the stop that follows is bounded anyway)."""
        while True:
            for number in os.read(self._read, 64):
                if number in self.signals:
                    return number


def _ignore(*_) -> None:
    pass


def timed_stop(role: str, phases: list[tuple[str, Callable[[], object]]],
               budget_s: float | None = STOP_BUDGET_S) -> None:
    """Run the stop phases in order, within `budget_s` in all: a phase stuck on a peer that is
    stopping too (a transfer, a deregistration) must not keep the process alive (None: no
    limit, for a worker inside another process). Slow and unfinished phases are logged, so a
    slow stop says where its time went."""
    t0 = time.monotonic()
    slow: list[str] = []
    current = ["", t0]

    def run() -> None:
        for name, fn in phases:
            current[:] = [name, time.monotonic()]
            try:
                fn()
            except Exception:  # noqa: BLE001 - stopping goes on with the next phase
                log.exception("%s: stopping %s failed", role, name)
            if (took := time.monotonic() - current[1]) > SLOW_STOP_S:
                slow.append(f"{name} {took:.1f}s")
        current[0] = ""

    thread = None
    if budget_s is None:
        run()
    else:
        thread = threading.Thread(target=run, name="stop", daemon=True)
        thread.start()
        thread.join(budget_s)
    if thread is not None and thread.is_alive():
        log.warning("%s: stopping %s still running after %.1fs; exiting without it (slow: %s)",
                    role, current[0], budget_s, ", ".join(slow) or "none")
    elif slow:
        log.warning("%s stopped in %.1fs (slow: %s)", role, time.monotonic() - t0,
                    ", ".join(slow))


def exit_now(code: int) -> None:
    """Flush and end the process, skipping interpreter teardown: unloading torch and the
    transfer libraries takes seconds and frees nothing the OS would not (SIGTERM must stop a
    whole `baton serve` cluster within 5 s)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
