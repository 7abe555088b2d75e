"""Restores and writes of the disk tier overlap other work (chain.py, background.py): a request
whose prefix is on disk waits in the "restoring" state while the engine steps the others, and
is admitted once the read is done; a dropped request or a failed read leaves nothing held and
changes no token; evicted snapshots are written on the tiers' I/O thread, never the engine's.

Reads and writes are gated by an Event (GatedIO) so each state is observed, not raced.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from baton.cache.tiers.fileio import FileIO
from baton.engine.loop import EngineLoop
from baton.engine.request import Request
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

PA = prompt(11, 40)  # the prefix that goes to disk
PB = prompt(22, 12)  # another request, running meanwhile


class GatedIO(FileIO):
    """Plain file I/O whose reads (or writes) wait for `gate`; `fail` makes reads raise."""

    def __init__(self, gate_reads=True, gate_writes=False):
        self.gate = threading.Event()
        self.gate_reads, self.gate_writes = gate_reads, gate_writes
        self.fail: type[Exception] | None = None
        self.threads: set[str] = set()

    def read(self, fd, offset, nbytes):
        self.threads.add(threading.current_thread().name)
        if self.gate_reads:
            assert self.gate.wait(30)
        if self.fail:
            raise self.fail("injected read failure")
        return super().read(fd, offset, nbytes)

    def write(self, fd, offset, buf):
        self.threads.add(threading.current_thread().name)
        if self.gate_writes:
            assert self.gate.wait(30)
        super().write(fd, offset, buf)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiers-async"))


def _engine(model_dir, tier_path=None, reuse=True):
    cache = {"tokens_per_block": 16, "num_blocks": 40, "num_state_slots": 6,
             "enable_prefix_reuse": reuse,
             "mamba_state_config": {"additional_snapshot_offsets_from_end": [0],
                                    "decode_end_snapshot": True}}
    if tier_path is not None:  # plain files in the pytest process (see test_cache_tiers_exact)
        cache["tier"] = {"path": str(tier_path), "bytes": 64 << 20, "io": "file"}
    return engine_for(model_dir, cache=cache, worker={"max_num_seqs": 2})


@pytest.fixture(scope="module")
def reference(model_dir):
    eng = _engine(model_dir, reuse=False)
    first = run_all(eng, [Request("a", PA, greedy(4))])["tokens"]["a"]
    a2 = PA + first + prompt(33, 9)
    res = run_all(eng, [Request("b", PB, greedy(20)), Request("a2", a2, greedy(5))])
    return first, a2, res["tokens"]


def _on_disk(model_dir, tmp_path, reference, io):
    """An engine whose pool held PA's decode-end snapshot, now only in the disk tier."""
    first, _, _ = reference
    eng = _engine(model_dir, tmp_path)
    assert eng.cache.tiers.io is not None  # a worker's tiers: background I/O
    assert run_all(eng, [Request("a", PA, greedy(4))])["tokens"]["a"] == first
    while eng.cache.tree.evict_snapshot():  # ... spilled to the disk tier
        pass
    while eng.cache.tree.evict_block():
        pass
    assert eng.cache.tiers.flush(30)
    assert eng.cache.tiers.disk.stats.admitted == 1
    eng.cache.tiers.disk.io = io
    return eng, eng.cache.num_available_blocks, eng.cache.num_free_slots


def _step_until(eng, outs, done, cond, limit=2000):
    for _ in range(limit):
        if cond():
            return
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = o
    raise AssertionError("engine made no progress")


def test_restore_waits_while_other_requests_step(model_dir, tmp_path, reference):
    first, a2, want = reference
    io = GatedIO()
    eng, blocks0, slots0 = _on_disk(model_dir, tmp_path, reference, io)
    outs, done = {}, {}
    eng.add_request(Request("b", PB, greedy(20)))
    eng.add_request(Request("a2", a2, greedy(5)))
    _step_until(eng, outs, done, lambda: len(outs.get("b", [])) >= 8)
    # a2's read is posted and blocked: it waits, b decodes, nothing of the pool is held for a2
    assert eng.cache.restore_pending("a2") and "a2" not in outs
    assert eng.requests["a2"].holds_cache is False
    assert eng.tracked()["tier_restores"] == 1
    assert io.threads == {"baton-tier-io"}
    io.gate.set()
    _step_until(eng, outs, done, lambda: len(done) == 2)
    assert outs == want
    n = len(PA) + len(first)
    assert done["a2"].cached_tokens == n
    st = eng.cache.stats().tiers["disk"]
    assert st["hits"] == 1 and st["hit_tokens"] == n
    assert eng.cache.restores_posted == 1 and eng.tracked()["tier_restores"] == 0
    assert eng.cache.num_free_slots == slots0
    eng.cache.check_integrity()


def test_dropped_while_restoring_leaves_nothing_held(model_dir, tmp_path, reference):
    _, a2, _ = reference
    io = GatedIO()
    eng, blocks0, slots0 = _on_disk(model_dir, tmp_path, reference, io)
    eng.add_request(Request("a2", a2, greedy(5)))
    eng.step()
    assert eng.cache.restore_pending("a2") and not eng.has_ready_work and eng.has_work
    assert eng.abort("a2")
    assert eng.tracked()["tier_restores"] == 0 and not eng.has_work
    io.gate.set()  # the read finishes after the drop: its result is thrown away
    assert eng.cache.tiers.flush(30)
    assert eng.cache.num_available_blocks == blocks0 and eng.cache.num_free_slots == slots0
    assert eng.cache.stats().tiers["disk"]["hits"] == 0
    eng.cache.check_integrity()


@pytest.mark.parametrize("exc, counter", [(OSError, "corrupt"), (RuntimeError, "errors")])
def test_failed_read_computes_the_prefix_with_the_same_tokens(model_dir, tmp_path, reference,
                                                              exc, counter):
    """An I/O error reading the entry removes it (as a damaged one); any other failure of the
    read is counted an error; the request computes its prefix either way."""
    first, a2, want = reference
    io = GatedIO(gate_reads=False)
    io.fail = exc
    eng, _, slots0 = _on_disk(model_dir, tmp_path, reference, io)
    res = run_all(eng, [Request("b", PB, greedy(20)), Request("a2", a2, greedy(5))])
    assert res["tokens"] == want
    assert res["outputs"]["a2"].cached_tokens == 0
    st = eng.cache.stats().tiers["disk"]
    assert st["hits"] == 0 and st[counter] == 1
    assert eng.tracked()["tier_restores"] == 0 and eng.cache.num_free_slots == slots0
    eng.cache.check_integrity()


def test_evicted_entries_are_written_off_the_engine_thread(model_dir, tmp_path, reference):
    """A write held up does not hold up the engine; the entry it writes counts as present
    (a request for it waits for write + read, in that order) and is committed only whole."""
    first, a2, want = reference
    eng = _engine(model_dir, tmp_path)
    io = eng.cache.tiers.disk.io = GatedIO(gate_reads=False, gate_writes=True)
    assert run_all(eng, [Request("a", PA, greedy(4))])["tokens"]["a"] == first
    while eng.cache.tree.evict_snapshot():
        pass
    while eng.cache.tree.evict_block():
        pass
    # the engine thread returned from the evictions; the write waits on the I/O thread
    assert eng.cache.tiers.disk.stats.admitted == 0
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".snap")]
    outs, done = {}, {}
    eng.add_request(Request("b", PB, greedy(20)))
    eng.add_request(Request("a2", a2, greedy(5)))
    _step_until(eng, outs, done, lambda: len(outs.get("b", [])) >= 5)
    assert eng.cache.restore_pending("a2") and "a2" not in outs
    io.gate.set()
    _step_until(eng, outs, done, lambda: len(done) == 2)
    assert outs == want and done["a2"].cached_tokens == len(PA) + len(first)
    assert io.threads == {"baton-tier-io"}
    assert eng.cache.tiers.disk.stats.admitted == 1
    eng.cache.check_integrity()


def test_engine_loop_sleeps_while_a_restore_is_in_flight(model_dir, tmp_path, reference):
    """The loop waits for the read's end (no polling): under 2% of a core meanwhile, and the
    read's end wakes it."""
    first, a2, want = reference
    io = GatedIO()
    eng, _, _ = _on_disk(model_dir, tmp_path, reference, io)
    loop = EngineLoop(eng)
    got, finished = [], threading.Event()

    def on_output(o):
        got.extend(o.new_token_ids)
        if o.finished:
            finished.set()

    try:
        loop.submit(Request("a2", a2, greedy(5)), on_output)
        deadline = time.monotonic() + 10
        while not eng.cache.restore_pending("a2"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        c0, t0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        busy = (time.process_time() - c0) / (time.monotonic() - t0)
        assert busy < 0.02, f"{busy:.1%} of a core while waiting for a tier read"
        io.gate.set()
        assert finished.wait(30)
        assert got == want["a2"]
    finally:
        io.gate.set()
        loop.stop()
