"""The decode worker's stream: every output already queued for a request goes into one chunk."""

from __future__ import annotations

import queue

from baton.contract import DecodeChunk, FinishReason
from baton.engine.request import RequestOutput
from decode_worker.service import drain_chunk


def out(*ids, reason=None, error=None):
    return RequestOutput("r", ids, reason is not None, reason, error=error)


def test_ready_outputs_are_merged_into_one_chunk_in_order():
    box = queue.Queue()
    for o in (out(4), out(5), out(6)):
        box.put(o)
    chunk, last = drain_chunk(box)
    assert chunk == DecodeChunk((4, 5, 6), None)
    assert last.new_token_ids == (6,) and box.empty()


def test_a_chunk_ends_at_the_finish_and_leaves_nothing_behind_it_unread():
    box = queue.Queue()
    for o in (out(4), out(5, reason=FinishReason.LENGTH)):
        box.put(o)
    chunk, last = drain_chunk(box)
    assert chunk == DecodeChunk((4, 5), FinishReason.LENGTH)
    assert last.finished and box.empty()


def test_one_output_at_a_time_gives_one_chunk_each():
    box = queue.Queue()
    box.put(out(7))
    assert drain_chunk(box)[0] == DecodeChunk((7,), None)
    box.put(out(8))
    assert drain_chunk(box)[0] == DecodeChunk((8,), None)


def test_an_abort_behind_ready_tokens_keeps_them_and_its_error():
    box = queue.Queue()
    box.put(out(4))
    box.put(out(reason=FinishReason.ABORT, error="aborted"))
    chunk, last = drain_chunk(box)
    assert chunk == DecodeChunk((4,), FinishReason.ABORT)
    assert last.error == "aborted"
