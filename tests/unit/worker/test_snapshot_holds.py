"""Decode-end snapshots held for a pull (decode_worker/ship.py) are background work.

A hold makes the transport poll often while it is out (a one-sided READ from this worker
progresses only when it calls into the transport: a hold without that waited for the next
housekeeping tick, a second a pull, and under a multi-turn load the holds piled up until they
filled worker.max_num_seqs and new turns were refused). Holds are capped at a share of the
live room; the cap refuses with CapacityError, the slot and blocks return on release.
"""

from __future__ import annotations

import pytest

from baton.contract import ReserveInput
from baton.engine.request import Request
from baton.errors import CapacityError
from decode_worker.ship import MAX_HOLD_SHARE, SnapshotHolds
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all
from transfer.base import RecvTransport
from transfer.receiver import SOURCE_INTERVAL_S, Receiver

MAX_SEQS = 8


class _Loop:
    """The engine loop's `call`, run inline (no loop thread in a unit test)."""

    def __init__(self, engine):
        self.engine = engine

    def call(self, fn, *args):
        return fn(*args)


class _Receiver:
    endpoint, incarnation = "tcp://127.0.0.1:1", "inc"

    def __init__(self):
        self.sources: list[tuple[str, bool]] = []

    def serve_reads(self, request_id: str, held: bool) -> None:
        self.sources.append((request_id, held))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = engine_for(make_checkpoint(tmp_path_factory.mktemp("holds")),
                     worker={"max_num_seqs": MAX_SEQS},
                     cache={"mamba_state_config": {"decode_end_snapshot": True}})
    return eng


def _finished_turns(engine, n: int) -> list[list[int]]:
    """n finished requests; their prompt + answer, each held as a decode-end snapshot (past
    the first block: each ends under its own tree node)."""
    reqs = [Request(f"turn{i}", prompt(40 + i, 20), greedy(3)) for i in range(n)]
    out = run_all(engine, reqs)["tokens"]
    return [r.prompt_ids + out[r.id] for r in reqs]  # the last answer token is fed too


def test_holds_are_capped_and_polled_while_out(engine):
    cap = max(1, int(MAX_SEQS * MAX_HOLD_SHARE))
    assert cap == 2
    turns = _finished_turns(engine, cap + 1)
    rx = _Receiver()
    holds = SnapshotHolds(_Loop(engine), rx, "decode-0", 30.0, None)
    live0 = engine.cache.live_room()
    res = [holds.hold(ReserveInput(f"ship-{i}", tuple(t))) for i, t in enumerate(turns[:cap])]
    assert [r.slot is not None for r in res] == [True] * cap
    assert engine.cache.live_room() == live0 - cap
    assert rx.sources == [("ship-0", True), ("ship-1", True)]
    with pytest.raises(CapacityError, match=r"holds 2 snapshots for pulls already"):
        holds.hold(ReserveInput("ship-2", tuple(turns[cap])))
    assert engine.cache.live_room() == live0 - cap  # the refused hold took nothing
    assert holds.release("ship-0") and not holds.release("ship-0")
    assert holds.hold(ReserveInput("ship-2", tuple(turns[cap]))).slot is not None
    for rid in ("ship-1", "ship-2"):
        assert holds.release(rid)
    assert rx.sources[2:] == [("ship-0", False), ("ship-2", True), ("ship-1", False),
                              ("ship-2", False)]
    assert engine.cache.live_room() == live0 and holds.tracked() == {"snapshot_holds": 0}
    holds.close()


class _NoTransport(RecvTransport):
    """No transport at all (NIXL must not load in the test process: UCXX may have)."""

    backend = "none"

    def __init__(self, cfg, pools, host, authorize):
        pass

    def metadata(self):
        return {}

    def drain(self):
        return []

    def close(self):
        pass


def test_the_receiver_polls_often_while_it_is_a_read_source(engine):
    from transfer import TransferConfig, compute_fingerprint

    rx = Receiver(TransferConfig(), engine.pools,
                  compute_fingerprint(engine.model.config, engine.pools.spec), "127.0.0.1",
                  _NoTransport)
    woken = []
    rx.on_activity = lambda: woken.append(1)
    try:
        assert rx.poll_interval() is None
        rx.serve_reads("ship-a", True)
        rx.serve_reads("ship-b", True)
        assert rx.poll_interval() == SOURCE_INTERVAL_S and woken == [1, 1]
        rx.serve_reads("ship-a", False)
        assert rx.poll_interval() == SOURCE_INTERVAL_S
        rx.serve_reads("ship-b", False)
        assert rx.poll_interval() is None
    finally:
        rx.close()
