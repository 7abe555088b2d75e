"""The router's stream of a request with n > 1 samples (router/samples.py): every sample ends
with its own summary, a sample stopped or failed alone leaves its siblings going."""

from __future__ import annotations

import time

import pytest

from baton.contract import DecodeChunk, FinishReason, GenerateSummary
from baton.errors import WorkerFailed
from router.cancellation import Cancellation
from router.samples import fan_out


def summary(reason: FinishReason) -> GenerateSummary:
    return GenerateSummary(reason, 5, 0, "p", "d", 1.0, 2.0, 0)


def run(chunks, cancel=None, stop_after=None, found=True):
    """`found`: what the decode worker's first abort of a sample answers."""
    cancel = cancel or Cancellation()
    aborted: list[int] = []

    def abort(sample: int) -> bool:
        aborted.append(sample)
        return found or len(aborted) > 1

    out = []
    for c in fan_out("r", 3, None, cancel, iter(chunks), summary, abort, "d",
                     prompt_logprobs=()):
        time.sleep(0.01)  # the background abort answers before the next chunk
        out.append((c.sample, c.token_ids, c.summary and c.summary.finish_reason))
        if stop_after is not None and len(out) == stop_after[0]:
            cancel.stop_sample(stop_after[1])
    return out, aborted


def test_each_sample_ends_alone_and_ends_after_a_first_token_are_not_repeated():
    chunks = [DecodeChunk((1,), sample=0), DecodeChunk((2,), FinishReason.STOP, sample=1),
              DecodeChunk((3,), sample=2),
              DecodeChunk((), FinishReason.STOP, sample=1),  # the decode side repeats it
              DecodeChunk((4, 5), FinishReason.LENGTH, sample=0),
              DecodeChunk((6,), FinishReason.ABORT, sample=2)]  # aborted there, unasked
    out, _ = run(chunks)
    assert out == [(0, (1,), None), (1, (2,), FinishReason.STOP), (2, (3,), None),
                   (0, (4, 5), FinishReason.LENGTH), (2, (6,), FinishReason.ERROR)]


def test_a_stopped_sample_gets_its_summary_with_the_next_chunk_and_is_aborted():
    chunks = [DecodeChunk((1,), sample=0), DecodeChunk((2,), sample=1),
              DecodeChunk((3,), sample=2), DecodeChunk((4,), sample=1),
              DecodeChunk((5,), FinishReason.ABORT, sample=1),
              DecodeChunk((6,), FinishReason.LENGTH, sample=0),
              DecodeChunk((7,), FinishReason.LENGTH, sample=2)]
    out, aborted = run(chunks, stop_after=(2, 1))
    assert out[:3] == [(0, (1,), None), (1, (2,), None), (1, (), FinishReason.STOP)]
    assert out[3:] == [(2, (3,), None), (0, (6,), FinishReason.LENGTH),
                       (2, (7,), FinishReason.LENGTH)]
    for _ in range(100):  # the abort runs on a thread of its own
        if aborted:
            break
        time.sleep(0.01)
    assert aborted == [1]


def test_a_stream_that_ends_with_samples_open_fails():
    with pytest.raises(WorkerFailed, match=r"samples \[1, 2\]"):
        run([DecodeChunk((1,), FinishReason.LENGTH, sample=0), DecodeChunk((2,), sample=1)])


def test_a_sample_stopped_before_the_fork_is_aborted_again_at_its_first_decode_chunk():
    cancel = Cancellation()
    cancel.stop_sample(2)  # at its first token, before Decode reached the worker
    chunks = [DecodeChunk((1,), sample=0), DecodeChunk((2,), sample=1),
              DecodeChunk((3,), sample=2), DecodeChunk((4,), sample=2),
              DecodeChunk((5,), FinishReason.LENGTH, sample=0),
              DecodeChunk((6,), FinishReason.LENGTH, sample=1)]
    out, aborted = run(chunks, cancel, found=False)
    assert out == [(2, (), FinishReason.STOP), (0, (1,), None), (1, (2,), None),
                   (0, (5,), FinishReason.LENGTH), (1, (6,), FinishReason.LENGTH)]
    for _ in range(100):
        if len(aborted) == 2:
            break
        time.sleep(0.01)
    assert aborted == [2, 2]  # at once, and again at its first chunk from the decode worker
