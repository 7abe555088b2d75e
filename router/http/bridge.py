"""Runs the orchestrator's blocking chunk stream on a thread and hands the chunks to asyncio.

    event loop                          pump thread (one per request)
    Chunks.next() ◄── asyncio.Queue ◄── for chunk in orchestrator.generate(inp, cancel)
    Chunks.close() ── cancel.cancel() ──► the in-flight worker call ends; generate() aborts
                                          both workers as it unwinds
    Chunks.stop()  ── cancel.stop() ────► the same, but generate() still ends with the summary
                                          (a stop string ended the answer), which is passed on

A client that disconnects is seen by `watch_disconnect`, which cancels the same way.

A request with n > 1 samples has one pump and one queue a sample: `Chunks.sample(i)` is what a
choice reads (`SampleChunks`); its `stop()` ends that sample alone (`Cancellation.stop_sample`),
a sample that failed alone raises in its own choice only, and the request is cancelled once
every choice closed.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import replace

from fastapi import Request

from baton.contract import FinishReason, GenerateChunk, GenerateInput
from baton.errors import WorkerFailed
from router.cancellation import Cancellation
from router.metrics import RequestTimer

_END = object()


class SampleFailed(WorkerFailed):
    """One sample of a request with n > 1 failed on its decode worker; its siblings go on."""


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Chunks:
    """One request's chunks as they arrive; `close()` cancels the request if it is running."""

    def __init__(self, orchestrator, inp: GenerateInput, timer: RequestTimer, pool: Executor):
        self.cancel = Cancellation()
        self.timer = timer
        self.n = inp.sampling.n
        self._queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(self.n)]
        self._loop = asyncio.get_running_loop()
        self._done = [False] * self.n
        self._failed: list[BaseException | None] = [None] * self.n
        self._open = set(range(self.n))
        self._summaries = 0
        self._future = self._loop.run_in_executor(pool, self._pump, orchestrator, inp)

    def sample(self, i: int) -> SampleChunks:
        """What choice `i` of the request reads (n > 1)."""
        return SampleChunks(self, i)

    async def next_batch(self, sample: int = 0) -> list[GenerateChunk]:
        """Every chunk of `sample` that has arrived (at least one); [] once the stream ended.
        Raises the request's error (or that sample's own)."""
        if self._failed[sample] is not None:
            exc, self._failed[sample] = self._failed[sample], None
            raise exc
        if self._done[sample]:
            return []
        queue = self._queues[sample]
        items = [await queue.get()]
        while not queue.empty():
            items.append(queue.get_nowait())
        out = []
        for item in items:
            if item is _END:
                self._done[sample] = True
            elif isinstance(item, _Failed):
                self._done[sample] = True
                if not out:
                    raise item.exc
                self._failed[sample] = item.exc  # the chunks before it go out first
            else:
                out.append(item)
        return out

    def close_sample(self, sample: int, outcome: str | None = None) -> None:
        """Choice `sample` is over: the request ends (as `close`) with the last one."""
        self._open.discard(sample)
        if not self._open:
            self.close(outcome)

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
                self._count(chunk)
                self._put_chunk(chunk)
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

    def _count(self, chunk: GenerateChunk) -> None:
        """The timer sees one summary: the last sample's."""
        if chunk.summary is not None and self.n > 1:
            self._summaries += 1
            if self._summaries < self.n:
                chunk = replace(chunk, summary=None)
        self.timer.chunk(chunk)

    def _put_chunk(self, chunk: GenerateChunk) -> None:
        s = chunk.summary
        if self.n > 1 and s is not None and s.finish_reason is FinishReason.ERROR:
            self._put(_Failed(SampleFailed(s.decode_worker, "Decode", (
                f"sample {chunk.sample} of request {chunk.request_id} failed there; the "
                "other samples went on"))), chunk.sample)
            return
        self._put(chunk, chunk.sample)

    def _put(self, item, sample: int | None = None) -> None:
        """Into `sample`'s queue (None: every sample's)."""
        queues = self._queues if sample is None else [self._queues[sample]]
        try:
            for q in queues:
                self._loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the event loop closed (server shutdown): nobody is listening
            self.cancel.cancel()


class SampleChunks:
    """Choice `i` of a request with n > 1: reads and ends that sample only."""

    def __init__(self, chunks: Chunks, i: int):
        self.chunks, self.i = chunks, i
        self.cancel = chunks.cancel

    async def next_batch(self) -> list[GenerateChunk]:
        return await self.chunks.next_batch(self.i)

    def stop(self) -> None:
        self.cancel.stop_sample(self.i)

    def close(self, outcome: str | None = None) -> None:
        self.chunks.close_sample(self.i, outcome)


async def watch_disconnect(request: Request, cancel: Cancellation) -> None:
    """Cancels the request when its client disconnects (run as a task once the body is read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.cancel()
            return
