"""Runs an engine in a background thread so servers can submit, stream and abort."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from baton.engine.engine import Engine
from baton.engine.request import Request, RequestOutput

log = logging.getLogger("baton.engine")

OutputCallback = Callable[[RequestOutput], None]


class EngineLoop:
    """Owns the engine; every engine call goes through `call()` under one lock."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._callbacks: dict[str, OutputCallback] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, req: Request, on_output: OutputCallback) -> None:
        """Queue a request; `on_output` runs on the engine thread for every step's output."""
        with self._lock:
            self.engine.add_request(req)
            self._callbacks[req.id] = on_output
            self._wake.notify()

    def call_watching(self, request_id: str, on_output: OutputCallback, fn: Callable, *args):
        """Like `call`, with `on_output` registered for `request_id` before the loop can step it."""
        with self._lock:
            self._callbacks[request_id] = on_output
            try:
                result = fn(*args)
            except BaseException:
                self._callbacks.pop(request_id, None)
                raise
            self._wake.notify()
            return result

    def call(self, fn: Callable, *args):
        """Run `fn(*args)` against the engine with the loop paused; wakes the loop after."""
        with self._lock:
            result = fn(*args)
            self._wake.notify()
            return result

    def abort(self, request_id: str) -> bool:
        """Free the request; a waiter still registered gets a final `abort` output."""
        with self._lock:
            cb = self._callbacks.pop(request_id, None)
            found = self.engine.abort(request_id)
        if cb is not None and found:
            cb(RequestOutput(request_id, (), True, "abort", error="aborted"))
        return found

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            cb = self._callbacks.get(out.request_id)
            if out.finished:
                self._callbacks.pop(out.request_id, None)
            if cb is not None:
                cb(out)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.engine.has_work:
                    self._wake.wait()
                if self._stop:
                    return
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - a failed step must not kill the server
                    log.exception("engine step failed; failing its requests")
                    outputs = self._fail_running(str(e))
            self.dispatch(outputs)

    def _fail_running(self, error: str) -> list[RequestOutput]:
        outs = []
        for req in list(self.engine.scheduler.running):
            self.engine.abort(req.id)
            outs.append(RequestOutput(req.id, (), True, "error", req.prompt_len, error=error))
        return outs
