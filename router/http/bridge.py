"""Runs the orchestrator's blocking chunk stream on a thread and hands the chunks to asyncio.

    event loop                          pump thread (one per request)
    Chunks.next() ◄── asyncio.Queue ◄── for chunk in orchestrator.generate(inp, cancel)
    Chunks.close() ── cancel.cancel() ──► the in-flight worker call ends; generate() aborts
                                          both workers as it unwinds
    Chunks.stop()  ── cancel.stop() ────► the same, but generate() still ends with the summary
                                          (a stop string ended the answer), which is passed on

A client that disconnects is seen by `watch_disconnect`, which cancels the same way.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from fastapi import Request

from baton.contract import GenerateChunk, GenerateInput
from router.cancellation import Cancellation
from router.metrics import RequestTimer

_END = object()


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Chunks:
    """One request's chunks as they arrive; `close()` cancels the request if it is running."""

    def __init__(self, orchestrator, inp: GenerateInput, timer: RequestTimer, pool: Executor):
        self.cancel = Cancellation()
        self.timer = timer
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._done = False
        self._failed: BaseException | None = None
        self._future = self._loop.run_in_executor(pool, self._pump, orchestrator, inp)

    async def next_batch(self) -> list[GenerateChunk]:
        """Every chunk that has arrived (at least one); [] once the stream ended. Raises the
        request's error."""
        if self._failed is not None:
            exc, self._failed = self._failed, None
            raise exc
        if self._done:
            return []
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        out = []
        for item in items:
            if item is _END:
                self._done = True
            elif isinstance(item, _Failed):
                self._done = True
                if not out:
                    raise item.exc
                self._failed = item.exc  # the chunks before it go out first
            else:
                out.append(item)
        return out

    def stop(self) -> None:
        """The answer is whole (a stop string): the request is cancelled on the workers, and
        its summary still comes as the last chunk."""
        self.cancel.stop()

    def close(self, outcome: str | None = None) -> None:
        """Ends the request: counted with `outcome` when given, cancelled if still running."""
        if outcome is not None:
            self.timer.end(outcome)
        self.cancel.cancel()

    def _pump(self, orchestrator, inp: GenerateInput) -> None:
        stream = None
        try:
            stream = orchestrator.generate(inp, self.cancel)
            for chunk in stream:
                self.timer.chunk(chunk)
                self._put(chunk)
                if self.cancel.cancelled and not self.cancel.stopped:
                    break  # a stopped request runs on to its summary (at once)
            self._put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the event loop
            self.timer.fail(e)
            self._put(_Failed(e))
        finally:
            if stream is not None:
                stream.close()  # aborts both workers unless the request finished
            # stopped (a stop string) yet no summary: the answer was whole all the same
            self.timer.end("stop" if self.cancel.stopped else None)

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop closed (server shutdown): nobody is listening
            self.cancel.cancel()


async def watch_disconnect(request: Request, cancel: Cancellation) -> None:
    """Cancels the request when its client disconnects (run as a task once the body is read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.cancel()
            return
