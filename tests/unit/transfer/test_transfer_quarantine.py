"""Claims, grants and quarantine over the real ZeroMQ side channel with the fake transport of
test_transfer_leases (no UCX library loaded), and the cache manager's side of a quarantine."""

from __future__ import annotations

import time

import pytest

from baton.cache.manager import HybridCacheManager
from baton.config.cache import CacheConfig
from baton.errors import CapacityError
from baton.model.pools import Pools, PoolSpec
from tests.unit.transfer.test_transfer_leases import MODEL, Link, make, poll_until
from transfer import receiver as receiver_mod
from transfer import wire
from transfer.base import TransferEvent
from transfer.fingerprint import compute_fingerprint
from transfer.receiver import Receiver
from transfer.sender import Sender
from transfer.side_channel import Client


@pytest.fixture
def held_pair():
    """Posts stay in flight (PROC) until the test finishes them; releases are recorded."""
    link = Link()
    link.auto = "PROC"
    cfg, spec, rc, sc = make(link)
    fp = compute_fingerprint(MODEL, spec)
    r = Receiver(cfg, Pools(spec), fp, "127.0.0.1", rc)
    s = Sender(cfg, Pools(spec), fp, sc)
    released: list[str] = []
    r.on_release = released.append
    yield link, r, s, released
    s.close()
    r.close()


def until(fn, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


def test_a_failed_reservation_that_was_never_granted_is_not_quarantined(held_pair):
    _, r, _, released = held_pair
    r.expect("a", [2, 3], 1)
    r.abort("a")
    assert r.poll() == [TransferEvent("a", False, "aborted by the decode worker", False)]
    assert r.held("a") is None and released == []


def test_no_claim_is_granted_once_the_reservation_failed(held_pair):
    link, r, s, _ = held_pair
    r.expect("b", [2, 3], 1)
    r.abort("b")
    s.send("b", r.endpoint, [0, 1], 0, [2, 3], 1)
    (ev,) = poll_until(s)
    assert not ev.ok and "no longer held here" in ev.error
    assert link.posts == []  # not one byte was posted


def test_a_claim_for_other_blocks_or_slot_is_denied(held_pair):
    link, r, s, _ = held_pair
    r.expect("c", [2, 3], 1)
    s.send("c", r.endpoint, [0, 1], 0, [2, 4], 1)
    (ev,) = poll_until(s)
    assert not ev.ok and "[4]" in ev.error and link.posts == []


def test_granted_then_failed_stays_quarantined_until_the_late_bytes_land(held_pair):
    link, r, s, released = held_pair
    r.expect("d", [2, 3], 1)
    s.send("d", r.endpoint, [0, 1], 0, [2, 3], 1)
    assert len(link.posts) == 1  # granted and posted; the bytes are held up
    r.abort("d")
    (ev,) = r.poll()
    assert (ev.request_id, ev.ok, ev.quarantined) == ("d", False, True)
    q = r.held("d")
    assert (q.blocks, q.slot) == (frozenset({2, 3}), 1)
    time.sleep(0.2)
    assert r.poll() == [] and released == [] and r.held("d") is not None
    link.finish()  # the held-up bytes land, then their notification
    until(lambda: r.poll() == [] and released == ["d"])
    assert r.held("d") is None and r.quarantined == {}


def test_the_sender_saying_it_posted_nothing_releases_at_once(held_pair):
    link, r, s, released = held_pair
    r.expect("e", [2, 3], 1)
    s.claim("e", r.endpoint, [2, 3], 1)
    until(lambda: r._expected["e"].writers)  # granted
    r.abort("e")
    assert r.poll()[0].quarantined
    s.abort("e")  # never sent: says so (posted = [])
    until(lambda: r.poll() == [] and released == ["e"])
    assert link.posts == []


def test_a_sender_that_gave_up_mid_transfer_keeps_the_posts_draining(held_pair):
    link, r, s, released = held_pair
    r.expect("f", [2, 3], 1)
    s.send("f", r.endpoint, [0, 1], 0, [2, 3], 1)
    s.abort("f")  # its abort names the layers it posted: the quarantine waits for them
    (ev,) = poll_until(r)
    assert ev.quarantined and "aborted by prefill" in ev.error
    assert r.held("f").writers and released == []
    assert s._draining  # the post is not cancelled: its bytes and notification still go
    link.finish()
    until(lambda: (s.poll(), r.poll()) and released == ["f"])
    assert s._draining == []


def test_a_writer_whose_connection_closed_is_released_after_the_grace(held_pair, monkeypatch):
    monkeypatch.setattr(receiver_mod, "QUARANTINE_GRACE_S", 0.3)
    link, r, s, released = held_pair
    r.expect("g", [2, 3], 1)
    s.send("g", r.endpoint, [0, 1], 0, [2, 3], 1)
    r.abort("g")
    assert r.poll()[0].quarantined
    s.close()  # the writer's process closes its endpoint (or exits)
    t0 = time.monotonic()
    until(lambda: r.poll() == [] and released == ["g"])
    assert time.monotonic() - t0 >= 0.3


def test_a_writer_gone_before_the_reservation_failed_is_released_after_the_grace(
        held_pair, monkeypatch):
    monkeypatch.setattr(receiver_mod, "QUARANTINE_GRACE_S", 0.3)
    link, r, s, released = held_pair
    r.expect("i", [2, 3], 1)
    s.send("i", r.endpoint, [0, 1], 0, [2, 3], 1)
    s.close()  # the prefill worker dies mid-transfer ...
    until(lambda: r._gone)
    r.abort("i")  # ... and only then does the decode side give the reservation up
    assert r.poll()[0].quarantined
    until(lambda: r.poll() == [] and released == ["i"])


def test_an_unauthenticated_claim_is_dropped():
    link = Link()
    cfg, spec, rc, _ = make(link)
    key = b"k" * 32
    r = Receiver(cfg, Pools(spec), compute_fingerprint(MODEL, spec), "127.0.0.1", rc, key)
    c = Client(r.endpoint, cfg.max_message_bytes, b"x" * 32)
    try:
        r.expect("h", [2], 1)
        c.send(wire.claim("h", 1, [2]))
        assert not c.wait(0.3)  # no grant, no denial
        assert r._expected["h"].writers == {}
        r.abort("h")
        assert r.poll()[0].quarantined is False
    finally:
        c.close()
        r.close()


def manager(num_blocks=8, slots=4, max_live=2):
    spec = PoolSpec.for_model(MODEL, num_blocks=num_blocks, tokens_per_block=4, num_slots=slots)
    return HybridCacheManager(CacheConfig(num_blocks=num_blocks, tokens_per_block=4,
                                          num_state_slots=slots), Pools(spec), max_live)


def test_cache_quarantine_keeps_blocks_and_slot_out_of_service_and_integrity_exact():
    m = manager()
    adm = m.admit_remote("q", list(range(12)))
    held, slot = adm.block_table, adm.slot
    m.quarantine("q", held, keep_slot=True)
    m.check_integrity()
    st = m.stats()
    assert (st.blocks_quarantined, st.slots_quarantined, st.quarantined_total) == (3, 1, 1)
    assert m.num_free_blocks == 5 and "q" not in m.live_requests()
    other = m.admit_remote("o", list(range(100, 120)))  # 5 blocks: all the rest
    assert not set(other.block_table) & set(held) and other.slot != slot
    with pytest.raises(CapacityError, match="1 quarantined"):  # max_live 2: one seat held
        m.admit_remote("p", [1, 2, 3])
    m.check_integrity()
    assert m.release_quarantine("q") and not m.release_quarantine("q")
    m.abort("o")
    m.check_integrity()
    assert m.num_free_blocks == 8 and m.stats().blocks_quarantined == 0


def test_cache_integrity_names_a_block_both_quarantined_and_free():
    m = manager()
    adm = m.admit_remote("q", list(range(8)))
    m.quarantine("q", adm.block_table, keep_slot=False)
    m.blocks.decref(adm.block_table[0])  # a bug that frees a quarantined block
    with pytest.raises(AssertionError, match=f"block {adm.block_table[0]}"):
        m.check_integrity()


def test_a_writer_whose_transfer_completed_says_so_and_the_quarantine_goes():
    """Pipeline-parallel prefill: several writers claim one reservation, each for its own
    layers. One finished (its layers landed), another never wrote; the decode side failed the
    reservation meanwhile. The finished one's `sent` (and the other's abort) release it; before,
    it stayed out of service for as long as the finished writer's connection lived."""
    link = Link()
    cfg, spec, rc, _ = make(link)
    r = Receiver(cfg, Pools(spec), compute_fingerprint(MODEL, spec), "127.0.0.1", rc)
    released: list[str] = []
    r.on_release = released.append
    done, idle = (Client(r.endpoint, cfg.max_message_bytes, None) for _ in range(2))
    try:
        r.expect("s", [2], 1)
        for c in (done, idle):
            c.send(wire.claim("s", 1, [2]))
            until(lambda c=c: c.wait(0.05))  # granted
        assert len(r._expected["s"].writers) == 2
        r.abort("s")
        (ev,) = r.poll()
        assert ev.quarantined and r.held("s") is not None
        idle.send(wire.encode("abort", rid="s", error="gave up", posted=[]))
        time.sleep(0.2)
        assert r.poll() == [] and released == []  # the other writer may still write
        done.send(wire.encode("sent", rid="s", posted=[]))
        until(lambda: r.poll() == [] and released == ["s"])
        assert r.held("s") is None and r.quarantined == {}
    finally:
        done.close()
        idle.close()
        r.close()


def test_a_writer_that_said_sent_before_the_failure_holds_nothing_up():
    """Out of order: the finished writer's `sent` arrives while the reservation is still held;
    the failure after it must not wait on that writer. Twice, or for a gone request: no-op."""
    link = Link()
    cfg, spec, rc, _ = make(link)
    r = Receiver(cfg, Pools(spec), compute_fingerprint(MODEL, spec), "127.0.0.1", rc)
    released: list[str] = []
    r.on_release = released.append
    done, idle = (Client(r.endpoint, cfg.max_message_bytes, None) for _ in range(2))
    try:
        r.expect("t", [2], 1)
        for c in (done, idle):
            c.send(wire.claim("t", 1, [2]))
            until(lambda c=c: c.wait(0.05))  # granted
        for _ in range(2):
            done.send(wire.encode("sent", rid="t", posted=[]))
        done.send(wire.encode("sent", rid="gone", posted=[0]))
        until(lambda: set() in r._expected["t"].writers.values())  # `sent` was read
        r.abort("t")
        (ev,) = r.poll()
        assert ev.quarantined  # the idle writer has said nothing yet
        idle.send(wire.encode("abort", rid="t", error="gave up", posted=[]))
        until(lambda: r.poll() == [] and released == ["t"])
        assert r.quarantined == {}
    finally:
        done.close()
        idle.close()
        r.close()


def test_a_grant_to_a_claim_given_up_never_lets_a_later_send_write(held_pair):
    """A claim made ahead was granted, the request aborted before the sender read the grant
    (it said it posted nothing: the decode side released the blocks at once), then a send of
    the same request started late (the router's cancel raced the prefill's handoff). The
    stale grant answered the first claim, not the send's own: not one byte may go (before,
    every layer was written into blocks the decode side had freed)."""
    link, r, s, released = held_pair
    r.expect("g", [2, 3], 1)
    s.claim("g", r.endpoint, [2, 3], 1)
    until(lambda: r._expected.get("g") is not None and r._expected["g"].writers)  # granted
    s.abort("g")  # nothing posted: posted = []
    until(lambda: "g" not in r.pending)
    (ev,) = r.poll()
    assert (ev.ok, ev.quarantined, r.held("g"), released) == (False, False, None, [])  # freed
    s.send("g", r.endpoint, [0, 1], 0, [2, 3], 1)
    (ev,) = poll_until(s)
    assert not ev.ok and "no longer held here" in ev.error
    assert link.posts == []
    assert s.tracked()["sender_claim_ids"] == 0 and s.tracked()["sender_grants"] == 0
