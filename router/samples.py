"""A request with n > 1 samples on the router: one stream of every sample's chunks.

    per-sample DecodeChunks (each names its sample)     ── the first tokens, then the decode
      │                                                     worker's stream (or Serve's)
    fan_out                                             one detokenizer a sample; a chunk of a
      │                                                 sample already ended is dropped
      ▼                                                 (the decode side repeats the ends of
    GenerateChunks, each with its sample; every         samples whose first token ended them)
    sample ends with its own summary

The client may end one sample's answer (`Cancellation.stop_sample`, an HTTP stop string):
that sample is aborted on the decode worker in the background, and its STOP summary goes out
with the stream's next chunk (one always comes while a sample is open: its own abort). A
sample stopped before the decode worker forked it is aborted again at its first chunk from
there. A sample that fails alone ends with an ERROR summary; its siblings go on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from baton.contract import DecodeChunk, FinishReason, GenerateChunk, GenerateSummary, PrefillResult
from baton.errors import WorkerFailed
from baton.model.detokenizer import IncrementalDetokenizer
from router.cancellation import Cancellation

Summary = Callable[[FinishReason], GenerateSummary]


def heads(first: PrefillResult) -> list[DecodeChunk]:
    """Every sample's first token (the prefill worker's reply) as its first chunk."""
    return [DecodeChunk((f.first_token_id,), f.finish_reason if f.finished else None,
                        logprobs=(f.logprobs,) if f.logprobs is not None else (), sample=i)
            for i, f in enumerate(first.firsts)]


def fan_out(rid: str, n: int, tokenizer, cancel: Cancellation, chunks: Iterator[DecodeChunk],
            summary: Summary, abort_sample: Callable[[int], bool], decode_worker: str,
            prompt_logprobs=(), on_end: Callable[[tuple[int, ...], int], None] | None = None,
            ) -> Iterator[GenerateChunk]:
    """Every sample's GenerateChunks until each has its summary; WorkerFailed when the stream
    ends first. `on_end(output, snapshot_tokens)`: sample 0 finished with these tokens, leaving
    a decode-end snapshot of that many tokens (the router indexes it as one turn)."""
    fan = _Fan(rid, n, tokenizer, summary, prompt_logprobs)
    sent0: list[int] = []
    missed: set[int] = set()
    """Stopped samples whose abort found nothing (Decode had not forked them yet)."""

    def stop(sample: int) -> None:
        def run():
            if not abort_sample(sample):
                missed.add(sample)

        threading.Thread(target=run, daemon=True, name=f"abort-{rid}-{sample}").start()

    with cancel.sample_hook(stop):
        for c in chunks:
            yield from fan.stopped(cancel.stopped_samples)
            if c.sample in missed and c.finish_reason is None:
                missed.discard(c.sample)  # it runs there now: this abort finds it
                threading.Thread(target=abort_sample, args=(c.sample,), daemon=True).start()
            if c.sample in fan.open:
                if c.sample == 0:
                    sent0.extend(c.token_ids)
                    if c.finish_reason is not None and on_end is not None:
                        on_end(tuple(sent0), c.snapshot_tokens)
                yield fan.chunk(c)
            if not fan.open:
                return
        yield from fan.stopped(cancel.stopped_samples)
    if fan.open:
        raise WorkerFailed(decode_worker, "Decode", f"stream ended without a finish_reason for "
                           f"samples {sorted(fan.open)}")


class _Fan:
    def __init__(self, rid: str, n: int, tokenizer, summary: Summary, prompt_logprobs):
        self.rid, self.summary = rid, summary
        self.open = set(range(n))
        self.detoks = [IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
                       for _ in range(n)]
        self.fresh = set(range(n))
        """Samples whose first chunk has not gone out (it carries the prompt logprobs)."""
        self.prompt_logprobs = tuple(prompt_logprobs)

    def stopped(self, samples: frozenset[int]) -> Iterator[GenerateChunk]:
        for i in sorted(samples & self.open):
            self.open.discard(i)
            yield GenerateChunk(self.rid, (), self._flush(i), self.summary(FinishReason.STOP),
                                sample=i)

    def chunk(self, c: DecodeChunk) -> GenerateChunk:
        i, reason = c.sample, c.finish_reason
        detok = self.detoks[i]
        text = detok.push(c.token_ids) if detok is not None else ""
        summary = None
        if reason is not None:
            self.open.discard(i)
            text += self._flush(i)
            # a sample the decode worker failed or aborted alone, unasked: an error for it
            summary = self.summary(FinishReason.ERROR if reason is FinishReason.ABORT
                                   else reason)
        plp = self.prompt_logprobs if i in self.fresh else ()
        self.fresh.discard(i)
        return GenerateChunk(self.rid, tuple(c.token_ids), text, summary, tuple(c.logprobs),
                             plp, i)

    def _flush(self, i: int) -> str:
        detok = self.detoks[i]
        return detok.flush() if detok is not None else ""
