"""Ending a role process (router or worker) once it has stopped cleanly."""

from __future__ import annotations

import logging
import os
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
