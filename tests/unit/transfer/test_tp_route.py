"""Tensor-parallel routing of one request over the real ZeroMQ side channel (fake transports,
no bytes moved): each prefill rank claims and writes only the decode ranks it has pieces for,
the pieces of all ranks cover every destination byte exactly once, a decode layer completes
only when every writer of it landed, and a decode rank that is not the shard its reservation
names is refused before anything is posted; a failed reservation stays quarantined only while
a granted writer's share may still land."""

from __future__ import annotations

import time

import pytest
import torch

from baton.errors import TransferError
from baton.model.nemotron_h.config import ModelConfig
from baton.model.nemotron_h.tp import local_config
from baton.model.pools import Pools, PoolSpec
from bench.harness.testbed import tiny_model
from tests.unit.transfer.test_transfer_leases import Link, make, poll_until, transports
from transfer import tp_identity
from transfer.base import TransferEvent
from transfer.layout import StageLayout
from transfer.receiver import Receiver
from transfer.sender import Sender
from transfer.tp_plan import expand
from transfer.tp_route import annotate, parse

# n_groups 1 and one KV head: B/C and KV replicated on every rank
MODEL = ModelConfig.from_dict(tiny_model("M*M", n_groups=1, num_key_value_heads=1))
TPB = 4


def pools(tp: int) -> Pools:
    return Pools(PoolSpec.for_model(local_config(MODEL, tp), num_blocks=8, tokens_per_block=TPB,
                                    num_slots=2, dtype=torch.float32))


def side(rank: int, size: int, link: Link, cls: int, p=None):
    fp, tp = tp_identity(MODEL, pools(size).spec, rank, size)
    return fp, tp, transports(link)[cls], p or pools(size)


def test_endpoint_place_round_trips_and_malformed_is_refused():
    assert parse(annotate("tcp://h:1", 1, 2)) == ("tcp://h:1", 1, 2)
    assert annotate("tcp://h:1", 0, 1) == "tcp://h:1" and parse("tcp://h:1") == ("tcp://h:1", 0, 1)
    for bad in ("tcp://h:1#tp=2/2", "tcp://h:1#tp=a/2", "tcp://h:1#tp=1"):
        with pytest.raises(TransferError, match=r"'#tp=RANK/SIZE' with 0 <= RANK < SIZE"):
            parse(bad)


@pytest.fixture
def p2_to_d1():
    """Prefill TP 2 (two senders) -> decode TP 1 (one receiver), fake transports."""
    link = Link()
    link.auto = "PROC"  # each post lands when the test says so
    fp, _, rc, rp = side(0, 1, link, 0)
    cfg = make(link)[0]
    r = Receiver(cfg, rp, fp, "127.0.0.1", rc)
    senders = []
    for rank in range(2):
        sfp, tp, sc, sp = side(rank, 2, link, 1)
        senders.append(Sender(cfg, sp, sfp, sc, tp=tp))
    yield link, r, senders
    for s in senders:
        s.close()
    r.close()


def test_both_prefill_ranks_write_and_the_layer_waits_for_both(p2_to_d1):
    link, r, (s0, s1) = p2_to_d1
    r.expect("a", [2, 3], 1)
    for s in (s0, s1):
        s.send("a", r.endpoint, [0, 1], 0, [2, 3], 1)
    assert len(link.posts) == 2
    link.posts[0][0] = "DONE"  # rank 0's bytes and notification land first
    link.inbox.append(link.posts[0][1])
    assert r.poll() == []  # Mamba layers 0 and 2 still wait for rank 1's x and ssm heads
    link.finish()
    assert poll_until(r) == [TransferEvent("a", True, None)]
    assert sorted(e.ok for e in poll_until(s0) + poll_until(s1)) == [True, True]


def test_pieces_cover_every_destination_byte_once():
    """Bytes rank 0 and rank 1 of TP 2 post into TP-1 rank 0 for 2 blocks and a slot: KV (one
    head, replicated) by rank 0 alone, conv x by both, B/C by rank 0, ssm heads by both."""
    _, t0, _, p0 = side(0, 2, Link(), 1)
    _, t1, _, _ = side(1, 2, Link(), 1)
    dst = StageLayout.from_pools(pools(1))
    src = StageLayout.from_pools(p0)
    got = [expand(t.pieces(0, 1), src, dst, [0, 1], 0, [2, 3], 1).nbytes for t in (t0, t1)]
    kv = 2 * dst.kv.block_bytes  # one attention layer, 2 blocks
    conv, ssm = (dst.state.tensor(n) for n in ("conv", "ssm"))
    x, b, c = conv.section_bytes
    assert got[0] == kv + 2 * (x // 2 + b + c + ssm.bytes // 2)
    assert got[1] == 2 * (x // 2 + ssm.bytes // 2)
    assert sum(got) == kv + 2 * (conv.bytes + ssm.bytes)  # every byte once
    # per layer, the writers a destination layer waits for: attention 1, Mamba 2
    assert t0.parts(0, 1, dst, [0, 1, 2]) == [2, 1, 2]


def test_a_rank_that_is_not_the_reserved_shard_is_refused_before_a_byte_moves(p2_to_d1):
    link, r, (s0, _) = p2_to_d1
    r.expect("b", [2], 1)
    s0.send("b", annotate(r.endpoint, 1, 2), [0], 0, [2], 1)  # says rank 1 of 2: it is TP 1
    (ev,) = poll_until(s0)
    assert not ev.ok and "names TP rank 1 of 2 but the peer is rank 0 of 1" in ev.error
    assert link.posts == []


def test_a_peer_whose_pools_are_not_its_declared_shard_is_refused():
    """A decode rank declaring rank 1 of 2 whose pools hold the whole model (as a bug that
    forgot to shard would): its conv / ssm bytes are not rank 1's, so nothing is posted."""
    link = Link()
    fp, _, rc, _ = side(1, 2, link, 0)
    cfg = make(link)[0]
    r = Receiver(cfg, pools(1), fp, "127.0.0.1", rc)
    sfp, tp, sc, sp = side(0, 1, link, 1)
    s = Sender(cfg, sp, sfp, sc, tp=tp)
    try:
        r.expect("c", [2], 1)
        s.send("c", r.endpoint, [0], 0, [2], 1)
        (ev,) = poll_until(s)
        assert not ev.ok and "where TP rank 1 of 2 holds" in ev.error, ev.error
        assert link.posts == []
    finally:
        s.close()
        r.close()


def test_a_failed_reservation_is_held_only_while_a_writer_may_still_land(p2_to_d1):
    """Rank 0's share landed and it said so; rank 1 was granted too and posted, but its bytes
    are still on the way: the failed reservation stays quarantined until they land, and is
    released then (not when rank 0's landing alone covered the layers' ids)."""
    link, r, (s0, s1) = p2_to_d1
    r.expect("q", [2, 3], 1)
    for s in (s0, s1):
        s.send("q", r.endpoint, [0, 1], 0, [2, 3], 1)
    link.posts[0][0] = "DONE"
    link.inbox.append(link.posts[0][1])
    assert [e.ok for e in poll_until(s0)] == [True]  # rank 0 done: it tells the receiver
    released = []
    r.on_release = released.append
    r.abort("q", "test")
    (ev,) = poll_until(r)
    assert not ev.ok and ev.quarantined and r.held("q") is not None
    s1.abort("q", "test")  # rank 1 says what it posted: every layer it holds a share of
    assert r.poll() == [] and r.held("q") is not None  # its bytes may still land
    link.finish()  # they do
    deadline = time.monotonic() + 3
    while not released and time.monotonic() < deadline:
        r.poll()
        time.sleep(0.005)
    assert released == ["q"] and r.held("q") is None


def test_a_writer_whose_share_landed_does_not_hold_the_quarantine(p2_to_d1):
    """Only rank 0 was granted and wrote (rank 1 never claimed): once its share landed and it
    said so, a failure there holds nothing, although rank 1's share of the layers is missing."""
    link, r, (s0, _) = p2_to_d1
    r.expect("w", [2], 1)
    s0.send("w", r.endpoint, [0], 0, [2], 1)
    link.finish()
    assert r.poll() == []  # rank 0's share landed; the Mamba layers wait for rank 1's
    assert [e.ok for e in poll_until(s0)] == [True]
    deadline = time.monotonic() + 3  # rank 0's `sent` (what it posted) reaches the receiver
    while None in r._expected["w"].writers.values() and time.monotonic() < deadline:
        time.sleep(0.005)
    r.abort("w", "test")
    (ev,) = poll_until(r)
    assert not ev.ok and not ev.quarantined and r.held("w") is None
