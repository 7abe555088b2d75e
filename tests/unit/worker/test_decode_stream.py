"""The decode worker's stream: every output already queued for a request goes into one chunk."""

from __future__ import annotations

import logging
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


class _Held:
    def __init__(self, blocks):
        self.blocks = blocks


class _Service:
    """What `_transfer_failed` touches of a decode service."""

    def __init__(self, held=None):
        self.receiver = type("R", (), {"held": lambda _s, rid: held})()
        self.ended, self.freed = [], []
        self._end_lease = self.ended.append
        self._free = self.freed.append


def _levels(caplog, error, held=None):
    from decode_worker.service import DecodeService
    caplog.clear()
    svc = _Service(held)
    with caplog.at_level(logging.INFO, logger="baton.decode"):
        DecodeService._transfer_failed(svc, "r1", error)
    assert svc.ended == ["r1"] and svc.freed == ["r1"]
    return [r.levelno for r in caplog.records]


def test_a_transfer_ended_because_its_request_ended_is_no_failure(caplog):
    """The router's Abort of a request its first token finished races the prefill's own word
    (ENDED_AT_FIRST_TOKEN): either way nothing was owed, so neither logs a warning; a real
    failure, or one whose blocks stay quarantined, still does (one that ended here only quarantines, routinely)."""
    from baton.contract import ENDED_AT_FIRST_TOKEN
    from decode_worker.service import ABORTED_HERE
    assert _levels(caplog, ABORTED_HERE) == [logging.INFO]
    assert _levels(caplog, f"aborted by prefill: {ENDED_AT_FIRST_TOKEN}") == [logging.INFO]
    assert _levels(caplog, "peer gone") == [logging.WARNING]
    assert _levels(caplog, ABORTED_HERE, _Held([3, 4])) == [logging.INFO]
    assert _levels(caplog, f"aborted by prefill: {ENDED_AT_FIRST_TOKEN}", _Held([3])) \
        == [logging.WARNING]
