"""Receiver / Sender bookkeeping over the real ZeroMQ side channel, with a fake transport.

The fake moves no bytes: a post completes when the test says so, and then delivers its
notification to the receiver, as NIXL does after the data. This isolates handshakes,
leases, aborts and events from any UCX library (no NIXL or ucxx loaded here).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from baton.config.transfer import TransferConfig
from baton.errors import TransferError
from baton.model.nemotron_h.config import ModelConfig
from baton.model.pools import Pools, PoolSpec
from bench.harness.testbed import tiny_model
from transfer import wire
from transfer.base import RecvTransport, SendTransport, TransferEvent
from transfer.fingerprint import compute_fingerprint
from transfer.receiver import Receiver
from transfer.sender import Sender

MODEL = ModelConfig.from_dict(tiny_model("MM-MM*-*M"))


class Link:
    """What the fake transports share: notifications in flight and post states."""

    def __init__(self):
        self.inbox: list[bytes] = []
        self.posts: list[list] = []  # [state, notif]
        self.auto = "DONE"

    def finish(self, state="DONE"):
        for p in self.posts:
            if p[0] == "PROC":
                p[0] = state
                if state == "DONE":
                    self.inbox.append(p[1])


def transports(link: Link):
    class FakeRecv(RecvTransport):
        backend = "fake"

        def __init__(self, cfg, pools, host, authorize):
            pass

        def metadata(self):
            return {"fake": True}

        def drain(self):
            out, link.inbox[:] = list(link.inbox), []
            return out

        def close(self):
            pass

    class FakeSend(SendTransport):
        backend = "fake"
        peers_added = 0

        def __init__(self, cfg, pools, layout):
            pass

        def add_peer(self, meta, layout):
            FakeSend.peers_added += 1
            return object()

        def remove_peer(self, peer):
            pass

        def post(self, peer, plan, notif):
            p = ["PROC", notif]
            link.posts.append(p)
            if link.auto == "DONE":
                link.finish()
            return p

        def check(self, post):
            return post[0], ("fake failure" if post[0] == "ERR" else None)

        def release(self, post):
            pass

        def close(self):
            pass

    return FakeRecv, FakeSend


def make(link, lease=5.0, layers=range(9), dtype=torch.float32):
    spec = PoolSpec.for_model(MODEL, num_blocks=8, tokens_per_block=4, num_slots=2,
                              layers=layers, dtype=dtype)
    cfg = TransferConfig(lease_seconds=lease, handshake_timeout_s=2.0)
    recv_cls, send_cls = transports(link)
    return cfg, spec, recv_cls, send_cls


@pytest.fixture
def pair():
    link = Link()
    cfg, spec, rc, sc = make(link)
    fp = compute_fingerprint(MODEL, spec)
    r = Receiver(cfg, Pools(spec), fp, "127.0.0.1", rc)
    s = Sender(cfg, Pools(spec), fp, sc)
    yield link, r, s, sc
    s.close()
    r.close()


def poll_until(end, n=1, timeout=3.0) -> list[TransferEvent]:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += end.poll()
        time.sleep(0.005)
    return got


def test_handoff_completes_on_both_sides(pair):
    link, r, s, _ = pair
    r.expect("a", [2, 3], 1, lease_s=5)
    s.send("a", r.endpoint, [0, 1], 0, [2, 3], 1)
    assert poll_until(s) == [TransferEvent("a", True, None)]
    assert poll_until(r) == [TransferEvent("a", True, None)]
    assert r.pending == []


def test_receiver_lease_expiry_reports_and_forgets(pair):
    _, r, _, _ = pair
    r.expect("late", [1], 0, lease_s=0.05)
    time.sleep(0.1)
    (ev,) = r.poll()
    assert ev.request_id == "late" and not ev.ok and "lease expired after 0.05 s" in ev.error
    assert r.pending == [] and r.poll() == []


def test_sender_lease_expiry_aborts_decode_early():
    link = Link()
    link.auto = "PROC"
    cfg, spec, rc, sc = make(link, lease=0.2)
    fp = compute_fingerprint(MODEL, spec)
    r = Receiver(TransferConfig(lease_seconds=30), Pools(spec), fp, "127.0.0.1", rc)
    s = Sender(cfg, Pools(spec), fp, sc)
    try:
        r.expect("slow", [1], 0)
        s.send("slow", r.endpoint, [1], 0, [1], 0)
        (ev,) = poll_until(s, timeout=2)
        assert not ev.ok and "lease expired" in ev.error
        (rev,) = poll_until(r, timeout=2)  # long before the receiver's own 30 s lease
        assert not rev.ok and "aborted by prefill" in rev.error
    finally:
        s.close()
        r.close()


def test_transport_error_fails_request_and_drops_peer(pair):
    link, r, s, sc = pair
    link.auto = "PROC"
    r.expect("x", [1], 0)
    s.send("x", r.endpoint, [1], 0, [1], 0)
    link.finish("ERR")
    (ev,) = poll_until(s)
    assert not ev.ok and ev.error == "fake failure"
    before = sc.peers_added
    link.auto = "DONE"
    r.expect("y", [2], 1)
    s.send("y", r.endpoint, [2], 1, [2], 1)
    assert poll_until(s) == [TransferEvent("y", True, None)]
    assert sc.peers_added == before + 1  # re-handshake after the failure


def test_receiver_close_says_bye_and_sender_fails_inflight(pair):
    link, r, s, _ = pair
    link.auto = "PROC"
    r.expect("z", [1], 0)
    s.send("z", r.endpoint, [1], 0, [1], 0)
    r.close()
    (ev,) = poll_until(s)
    assert not ev.ok and "closed" in ev.error


def test_stray_blocks_and_wrong_slot_fail_the_request(pair):
    link, r, _, _ = pair
    r.expect("s", [4, 5], 1)
    link.inbox.append(wire.landed("s", [5, 7], 1, [4, 6]))
    (ev,) = r.poll()
    assert not ev.ok and "[6]" in ev.error
    r.expect("t", [4], 1)
    link.inbox.append(wire.landed("t", [5], 0, [4]))
    (ev,) = r.poll()
    assert not ev.ok and "slot 0" in ev.error


def test_completion_needs_every_layer_and_early_notifications_count(pair):
    link, r, _, _ = pair
    link.inbox.append(wire.landed("m", [0, 1, 3, 4], 0, [1]))  # before expect()
    assert r.poll() == []
    r.expect("m", [1], 0)
    link.inbox.append(wire.landed("m", [5, 7], 0, [1]))
    assert r.poll() == []  # layer 8 still missing
    link.inbox.append(wire.landed("m", [8], 0, []))
    assert r.poll() == [TransferEvent("m", True, None)]
    link.inbox.append(b"\x93garbage")
    assert r.poll() == []


def test_fingerprint_refusal_names_the_field():
    link = Link()
    cfg, spec, rc, sc = make(link)
    _, spec16, _, _ = make(link, dtype=torch.float16)
    r = Receiver(cfg, Pools(spec), compute_fingerprint(MODEL, spec), "127.0.0.1", rc)
    s = Sender(cfg, Pools(spec16), compute_fingerprint(MODEL, spec16), sc)
    try:
        with pytest.raises(TransferError, match="'dtype' differs"):
            s.connect(r.endpoint)
        s.send("q", r.endpoint, [1], 0, [1], 0)
        (ev,) = s.poll()
        assert not ev.ok and "'dtype'" in ev.error
    finally:
        s.close()
        r.close()


def test_unreachable_decode_times_out_with_a_clear_error():
    link = Link()
    cfg, spec, _, sc = make(link)
    s = Sender(TransferConfig(handshake_timeout_s=0.2), Pools(spec),
               compute_fingerprint(MODEL, spec), sc)
    try:
        s.send("u", "tcp://127.0.0.1:9", [1], 0, [1], 0)
        (ev,) = s.poll()
        assert not ev.ok and "no handshake reply" in ev.error
    finally:
        s.close()


def test_concurrent_senders_threads(pair):
    _, r, s, _ = pair
    rids = [f"t{i}" for i in range(40)]
    for rid in rids:
        r.expect(rid, [1], 0)

    def worker(mine):
        for rid in mine:
            s.send(rid, r.endpoint, [1], 0, [1], 0)
            s.poll()

    threads = [threading.Thread(target=worker, args=(rids[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    evs = s.poll()
    assert len(evs) <= 40
    assert {e.request_id for e in poll_until(r, n=40)} == set(rids)
