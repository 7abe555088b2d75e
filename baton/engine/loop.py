"""Runs an engine in a background thread so servers can submit, stream and abort.

Only the loop thread touches the engine. Other threads hand it commands (`call`), which
run between two steps in arrival order: a Reserve or Abort waits at most one step, however
busy the engine is (a plain lock would let the stepping thread starve them).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from baton.contract import FinishReason
from baton.engine.engine import Engine
from baton.engine.request import Request, RequestOutput

log = logging.getLogger("baton.engine")

OutputCallback = Callable[[RequestOutput], None]


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: deque[tuple[Callable, tuple, Future]] = deque()
        self._callbacks: dict[str, OutputCallback] = {}
        self._stop = False
        tiers = _tiers(engine)
        if tiers is not None:
            tiers.on_ready = self._wake  # a tier read done: its request can run
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- for other threads -------------------------------------------------------------
    def call(self, fn: Callable, *args):
        """Run `fn(*args)` on the loop thread between steps; returns its result or raises."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        fut: Future = Future()
        with self._cond:
            if self._stop:
                raise RuntimeError("engine loop is stopped")
            self._commands.append((fn, args, fut))
            self._cond.notify()
        return fut.result()

    def submit(self, req: Request, on_output: OutputCallback) -> None:
        """Queue a request; `on_output` runs on the loop thread for every output of it. Its
        grammar, if any, compiles here, on the caller's thread, not between steps."""
        self.engine.grammars.prepare(req.sampling.grammar)
        self.call_watching(req.id, on_output, self.engine.add_request, req)

    def call_watching(self, request_id: str, on_output: OutputCallback, fn: Callable, *args):
        """Like `call`, with `on_output` registered for `request_id` before the loop steps it."""

        def run():
            self._callbacks[request_id] = on_output
            try:
                return fn(*args)
            except BaseException:
                self._callbacks.pop(request_id, None)
                raise

        return self.call(run)

    def abort(self, request_id: str, hold: Callable[[], tuple | None] | None = None) -> bool:
        """Free the request; a waiter still registered gets a final `abort` output. `hold`
        (asked on the loop thread): None to free everything, or (key, blocks, keep_slot) to
        keep those out of service (`Engine.quarantine`)."""

        def run():
            cb = self._callbacks.pop(request_id, None)
            q = hold() if hold is not None else None
            found = (self.engine.abort(request_id) if q is None
                     else self.engine.quarantine(request_id, *q))
            if cb is not None and found:
                cb(RequestOutput(request_id, (), True, FinishReason.ABORT, error="aborted"))
            return found

        return self.call(run)

    def abort_sample(self, request_id: str, sample: int) -> bool:
        """Free one sample of a request with n > 1 (its siblings go on); its waiter gets that
        sample's `abort` output. False when that sample is not running."""

        def run():
            left = self.engine.abort_sample(request_id, sample)
            if left is None:
                return False
            cb = self._callbacks.get(request_id) if left else self._callbacks.pop(request_id, None)
            if cb is not None:
                cb(RequestOutput(request_id, (), True, FinishReason.ABORT, error="aborted",
                                 sample=sample, open_samples=left))
            return True

        return self.call(run)

    def tracked(self) -> dict[str, int]:
        """Per-request bookkeeping sizes (worker Stats `tracked_*`)."""
        return {"output_callbacks": len(self._callbacks), **self.engine.tracked()}

    def _ready(self) -> bool:
        """Work a step can do now (not only requests waiting for a tier read)."""
        ready = getattr(self.engine, "has_ready_work", None)
        return self.engine.has_work if ready is None else ready

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)
        tiers = _tiers(self.engine)
        if tiers is not None:
            tiers.close()  # finish the queued tier writes

    # ---- the loop thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._commands and not self._ready():
                    self._cond.wait()
                if self._stop:
                    self._fail_commands()
                    return
                commands = list(self._commands)
                self._commands.clear()
            for fn, args, fut in commands:
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed back to the caller
                    fut.set_exception(e)
            if self.engine.has_work:
                self._dispatch(self._step())

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as e:  # noqa: BLE001 - a failed step must not kill the server
            # Engine.step confines request failures to their requests; reaching here means the
            # engine itself is broken, so nothing in it can be trusted to continue
            log.exception("engine step failed outside any request; failing every request")
            outs = []
            sched = self.engine.scheduler
            for req in [*sched.running, *sched.waiting]:
                if self.engine.abort(req.key):  # every sample: one output ends the request
                    outs.append(RequestOutput(req.key, (), True, FinishReason.ERROR,
                                              req.prompt_len, error=str(e)))
            return outs

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            # the callback serves every sample of a request: it goes with the last one
            done = out.finished and not out.open_samples
            cb = self._callbacks.pop(out.request_id, None) if done else \
                self._callbacks.get(out.request_id)
            if cb is not None:
                cb(out)

    def _fail_commands(self) -> None:
        for _, _, fut in self._commands:
            fut.set_exception(RuntimeError("engine loop is stopped"))
        self._commands.clear()


def _tiers(engine):
    """The engine's cache tiers (cache/tiers/), None when it has none."""
    return getattr(getattr(engine, "cache", None), "tiers", None)
