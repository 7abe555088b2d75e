"""Prefill side of one stage: handshakes with decode stages, plans and posts writes, leases.

Life of a transfer on the prefill side:
  1. `claim(rid, endpoint(s), dst blocks/slot)` (optional, as soon as the destination is
     known): asks each decode stage for the right to write the reservation; the grant comes
     back while the prompt computes;
  2. `send(rid, endpoint(s), src blocks/slot, dst blocks/slot, skip_blocks)`:
     first contact with an endpoint runs the handshake (fingerprint checked both ways,
     the peer's layout and transport metadata kept, its memory prepped once); unclaimed
     destinations are claimed here (waiting for the grant, up to handshake_timeout_s);
  3. per decode stage, once granted: `plan()` over the shared layers, one post with a `landed`
     notification (layer-wise mode: one post per layer, as `layer_done()` reports layers);
     a denied claim fails the request before a byte moves;
  4. `poll()` reports `(rid, True)` once every post is DONE, or `(rid, False, why)` on a
     transport error, a closed peer, `abort()`, or lease expiry; failures also tell the
     decode side (`abort` message, with the layers posted there) so it frees its blocks
     before its own lease runs out. Posts still in flight are not cancelled but drained:
     their bytes and `landed` notification still reach the decode side, which keeps the
     blocks quarantined until then (see receiver.py).
The prefill worker frees its copy of the blocks after either event.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from baton import envs
from baton.config.transfer import TransferConfig
from baton.errors import TransferError
from baton.model.pools import Pools
from transfer import fingerprint as fp
from transfer import tp_route, wire
from transfer.base import SendTransport, TransferEvent
from transfer.layout import StageLayout
from transfer.planner import Plan, plan
from transfer.side_channel import Client
from transfer.tp_plan import expand
from transfer.tp_route import TPSide

WATCH_INTERVAL_S = 0.0002
"""Poll interval while writes are in flight (progress happens only when we poll)."""
DRAIN_LEASES = 4
"""How long (in leases) a failed request's post may drain before its handle is released: its
bytes and notification still release the decode side's quarantine when they arrive."""
DRAIN_INTERVAL_S = 0.05
"""Poll interval while only failed requests' posts drain or claims wait for their send."""
STREAMING_INTERVAL_S = 0.005
"""Poll interval while layer-wise requests are still computing: early layers progress a little,
the forward keeps the GIL; `layers_done` of the last layer wakes the poller (see the service)."""
TEST_HOLD_ENV = envs.TEST_TRANSFER_HOLD_S.name
"""Tests only (the chaos matrix): a transfer is reported done no sooner than this many seconds
after it started, so that a process can be killed while transfers are in flight."""


def _test_hold_s() -> float:
    return envs.TEST_TRANSFER_HOLD_S.get()


@dataclass
class _Peer:
    client: Client
    layout: StageLayout
    handle: object
    incarnation: str = ""
    fingerprint: dict = field(default_factory=dict)
    """The peer's own (its TP size and rank: checked against the reservation's place)."""


@dataclass
class _InFlight:
    deadline: float
    plans: list[tuple[_Peer, Plan]]
    notify: tuple
    """(slot, dst blocks) repeated in every notification."""
    peers: list[_Peer] = field(default_factory=list)
    """Every decode stage contacted for this request (told on failure)."""
    posts: list[tuple[_Peer, object]] = field(default_factory=list)
    unsent: set[int] = field(default_factory=set)
    """Layers still to post (layer-wise mode)."""
    waiting: list[_Peer] = field(default_factory=list)
    """Decode stages whose grant has not arrived yet (nothing is posted before it does)."""
    ready: set[int] = field(default_factory=set)
    """Layers final on this side, waiting for the grants to be posted."""
    posted: dict[int, set[int]] = field(default_factory=dict)
    """id(peer) -> layers posted there (told in the abort message on failure); a decode
    stage is told `posted` at its first post (its poller watches until it lands)."""
    read: bool = False
    """The other way round: READ the peer's units into the local ones (nothing to claim, nothing
    posted to tell it)."""
    hold_until: float = 0.0
    """Not done before this time.monotonic() (TEST_HOLD_ENV)."""
    parts: dict[int, dict[int, int]] = field(default_factory=dict)
    """id(peer) -> layer -> writers of that layer there (tensor-parallel plans; else 1)."""


class Sender:
    """Thread-safe: one lock guards the transport, the peers and the in-flight table."""

    def __init__(self, cfg: TransferConfig, pools: Pools, fingerprint: dict,
                 transport_cls: type[SendTransport], key: bytes | None = None,
                 tp: TPSide | None = None):
        self.cfg = cfg
        self.tp = tp
        """This sender's TP rank and the whole model: plans pieces for decode ranks of any TP
        size (None: whole-model stages on both sides only)."""
        self.layout = StageLayout.from_pools(pools)
        self.fingerprint = fingerprint
        self._key = key
        """Side-channel key from the cluster secret (None: messages go unsealed)."""
        self._lock = threading.Lock()
        self._transport = transport_cls(cfg, pools, self.layout)
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[str, _InFlight] = {}
        self._events: list[TransferEvent] = []
        self._grants: dict[tuple[str, str], str | None] = {}
        """(endpoint, rid) -> None: granted, "": claimed and no answer yet, else why denied."""
        self._claim_ids: dict[tuple[str, str], int] = {}
        """(endpoint, rid) -> the number of its claim awaiting an answer: the answer to a claim
        given up on (aborted before its grant came) must not pass for the next one's."""
        self._next_claim = itertools.count(1)
        self._claims: dict[str, tuple[float, list[str]]] = {}
        """rid -> (when, endpoints) claimed ahead of `send`."""
        self._draining: list[tuple[_Peer, object, float]] = []
        """Posts of failed requests still in flight: (peer, post, give-up time). Released once
        done or failed, so their bytes and notification still reach the decode side."""
        self._hold_s = _test_hold_s()
        self._connecting: dict[str, threading.Lock] = {}
        """One lock per endpoint: its handshake runs once, outside `_lock`."""
        self._outbox: list[tuple[_Peer, bytes]] = []
        """`sent` messages of requests done, sent at the end of the poll that found them done
        (after every peer was read), before it returns their events: a sender is not polled
        again while idle, and the decode side ends a quarantine on them."""

    @property
    def in_flight(self) -> int:
        """Requests being sent now (posted or waiting for layers, not yet done or failed)."""
        with self._lock:
            return len(self._inflight)

    def tracked(self) -> dict[str, int]:
        """Per-request bookkeeping sizes (worker Stats `tracked_*`)."""
        with self._lock:
            return {"sender_in_flight": len(self._inflight), "sender_claims": len(self._claims),
                    "sender_grants": len(self._grants), "sender_claim_ids": len(self._claim_ids),
                    "sender_draining": len(self._draining),
                    "sender_events": len(self._events)}

    def claim(self, request_id: str, endpoint: str | Sequence[str],
              dst_block_ids: Sequence[int], dst_slot: int | None, skip_blocks: int = 0,
              incarnation: str | None = None) -> None:
        """Ask each decode stage for the right to write this reservation, now (handshaking
        first, outside the lock, with an endpoint not connected yet: TransferError if
        refused); never waits for the grant, which `send` or `poll` picks up."""
        endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        for ep in endpoints:
            self.connect(ep)
        with self._lock:
            if request_id in self._inflight or request_id in self._claims:
                return
            self._claims[request_id] = (time.monotonic(), endpoints)
            for ep in endpoints:
                peer = self._peer_of(ep, incarnation, request_id)
                if set(self.layout.layers) & set(peer.layout.layers) and self._writes(ep, peer):
                    self._send_claim(ep, peer, request_id, dst_slot, dst_block_ids[skip_blocks:])

    def connect(self, endpoint: str) -> StageLayout:
        """Handshake with a decode stage now (send() does it lazily); TransferError if refused.
        The wait for the reply holds no lock of the sender: a decode peer that does not answer
        (it died) holds up this caller alone for up to handshake_timeout_s, never the
        transfers to other peers (their polls need the lock)."""
        with self._lock:
            if endpoint in self._peers:
                return self._peers[endpoint].layout
            gate = self._connecting.setdefault(endpoint, threading.Lock())
        with gate:  # one handshake per endpoint at a time
            with self._lock:
                if endpoint in self._peers:
                    return self._peers[endpoint].layout
            client, reply = self._hello(endpoint)
            with self._lock:
                return self._adopt(endpoint, client, reply).layout

    def peer_layout(self, endpoint: str) -> StageLayout | None:
        """The layout of a decode stage handshaken already, else None (never handshakes: safe
        on the engine loop thread)."""
        with self._lock:
            peer = self._peers.get(endpoint)
            return None if peer is None else peer.layout

    def send(self, request_id: str, endpoint: str | Sequence[str], src_block_ids: Sequence[int],
             src_slot: int | None, dst_block_ids: Sequence[int], dst_slot: int | None,
             skip_blocks: int = 0, incarnation: str | None = None,
             layerwise: bool = False, read: bool = False, handshake: bool = True) -> None:
        """Start moving one request to every decode stage in `endpoint`; never blocks on data.
        `handshake`: first contact with an endpoint handshakes here (outside the lock, so
        only this caller waits); False: an endpoint not connected already fails the request at
        once (the prefill worker connects on its RPC thread first and calls this on its engine
        loop thread, which must never wait for a peer that died meanwhile).
        `incarnation`: the receiver the destination was reserved on; another one (the decode
        worker restarted at the same endpoint) fails the request before a byte moves.
        Layer-wise, nothing leaves before `layers_done` (the prefill worker asks for it when
        `transfer.layerwise` is on and the request's last chunk is still to run).
        `read`: the other way round, one-sided: the peer's `dst` blocks and slot (a decode
        worker's held snapshot) are read into the local `src` ones; done when they are here."""
        endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        unreachable = None
        if handshake:
            for ep in endpoints:
                try:
                    self.connect(ep)
                except Exception as e:  # noqa: BLE001 - the request fails, not the caller
                    unreachable = str(e) if isinstance(e, TransferError) else \
                        f"{type(e).__name__}: {e}"
                    break
        with self._lock:
            if request_id in self._inflight:
                raise TransferError(f"request {request_id!r} is already being sent")
            now = time.monotonic()
            fl = _InFlight(now + self.cfg.lease_seconds, [],
                           (dst_slot, list(dst_block_ids[skip_blocks:])), read=read,
                           hold_until=now + self._hold_s)
            self._inflight[request_id] = fl
            self._claims.pop(request_id, None)
            try:
                if unreachable is not None:
                    raise TransferError(unreachable)
                for ep in endpoints:
                    peer = self._peer_of(ep, incarnation, request_id)
                    fl.peers.append(peer)
                    p = self._plan(ep, peer, fl, src_block_ids, src_slot, dst_block_ids,
                                   dst_slot, skip_blocks)
                    if p.layers:
                        fl.plans.append((peer, p))
                        fl.unsent |= set(p.layers)
                    if not p.layers or fl.read:
                        continue  # nothing to write (no layer in common, or a READ): no claim
                    if (ep, request_id) not in self._grants:  # not claimed ahead: claim now
                        self._send_claim(ep, peer, request_id, dst_slot,
                                         dst_block_ids[skip_blocks:])
                        self._await_grant(ep, peer, request_id)
                    self._read(ep, peer)  # a grant to a claim made ahead may be waiting
                    answer = self._grants.get((ep, request_id), "")
                    if answer:
                        raise TransferError(f"decode peer {ep} refused the write: {answer}")
                    if answer == "":
                        fl.waiting.append(peer)
                if not layerwise and request_id in self._inflight:
                    self._post_layers(request_id, fl, set(fl.unsent))
            except Exception as e:  # the request fails, the caller's thread does not
                why = str(e) if isinstance(e, TransferError) else f"{type(e).__name__}: {e}"
                self._finish(request_id, why)

    def layer_done(self, request_id: str, layer: int) -> None:
        """Layer-wise mode: prefill finished global `layer`; its bytes leave now."""
        self.layers_done(request_id, [layer])

    def layers_done(self, request_id: str, layers: Sequence[int]) -> None:
        """Layer-wise mode: these global layers are final; their bytes leave in one post per
        decode stage."""
        with self._lock:
            fl = self._inflight.get(request_id)
            todo = fl.unsent.intersection(layers) if fl is not None else None
            if todo:
                self._post_layers(request_id, fl, todo, early=False)

    def abort(self, request_id: str, reason: str = "aborted by the prefill worker") -> None:
        with self._lock:
            self._finish(request_id, reason)
            self._unclaim(request_id, reason)

    def poll_interval(self) -> float | None:
        """How soon `poll()` should run again; None: nothing in flight until woken. Slowly while
        every in-flight request still has layers to post (a layer-wise forward is running: a
        fast poller would take the GIL from it, and nothing can finish before its last post)."""
        with self._lock:
            if not self._inflight:
                return DRAIN_INTERVAL_S if self._draining or self._claims else None
            streaming = all(fl.unsent and not fl.waiting for fl in self._inflight.values())
            if streaming or self._hold_s:  # held (tests): no need to spin meanwhile
                return STREAMING_INTERVAL_S
            return WATCH_INTERVAL_S

    def poll(self) -> list[TransferEvent]:
        """Delivered and failed requests since the last call."""
        with self._lock:
            for ep, peer in list(self._peers.items()):
                self._read(ep, peer)
            now = time.monotonic()
            for rid, fl in list(self._inflight.items()):
                if fl.waiting:
                    self._check_grants(rid, fl)
                    if rid in self._inflight and not fl.waiting and fl.ready:
                        self._post_layers(rid, fl, set(fl.ready))
                if rid in self._inflight:
                    self._progress(rid, fl, now)
            self._drain(now)
            for rid, (t, _) in list(self._claims.items()):
                if now - t > self.cfg.lease_seconds:
                    self._unclaim(rid, "claimed but never sent within the lease")
            self._flush()  # in this poll: a sender may not be polled again while idle
            out, self._events = self._events, []
            return out

    def close(self) -> None:
        with self._lock:
            self._flush()
            for rid in list(self._inflight):
                self._finish(rid, "sender closed")
            for rid in list(self._claims):
                self._unclaim(rid, "sender closed")
            for _, post, _ in self._draining:
                self._transport.release(post)
            self._draining = []
            for ep in list(self._peers):
                self._drop_peer(ep, "sender closed")
            self._transport.close()

    # -- internals (lock held) ------------------------------------------------------------

    def _tp_pair(self, ep: str, peer: _Peer) -> tuple[int, int] | None:
        """(decode rank, its TP size) when this pair is planned by tensor-parallel pieces;
        None for whole-model stages on both sides (the per-stage planner)."""
        _, d, q = tp_route.parse(ep)
        if (self.tp is None or self.tp.size == 1) and q == 1 \
                and peer.fingerprint.get("tp_size", 1) == 1:
            return None
        if self.tp is None:
            raise TransferError(f"decode peer {ep} is a tensor-parallel rank but this sender "
                                "has no TP plan; nothing was sent")
        self.tp.check_peer(ep, d, q, peer.fingerprint, peer.layout)
        return d, q

    def _writes(self, ep: str, peer: _Peer) -> bool:
        """Whether this rank has anything to write into that decode rank."""
        pair = self._tp_pair(ep, peer)
        return pair is None or bool(self.tp.pieces(*pair))

    def _plan(self, ep: str, peer: _Peer, fl: _InFlight, src_blocks, src_slot, dst_blocks,
              dst_slot, skip: int) -> Plan:
        pair = self._tp_pair(ep, peer)
        if pair is None:
            return plan(self.layout, peer.layout, src_blocks, src_slot, dst_blocks, dst_slot,
                        skip)
        if fl.read:
            raise TransferError(f"reading back from decode peer {ep} is not built for "
                                "tensor-parallel pairs; nothing was read")
        p = expand(self.tp.pieces(*pair), self.layout, peer.layout, src_blocks, src_slot,
                   dst_blocks, dst_slot, skip)
        fl.parts[id(peer)] = dict(zip(p.layers, self.tp.parts(*pair, peer.layout, p.layers),
                                      strict=True))
        return p

    def _peer(self, endpoint: str) -> _Peer:
        if endpoint in self._peers:
            return self._peers[endpoint]
        client, reply = self._hello(endpoint)
        return self._adopt(endpoint, client, reply)

    def _hello(self, endpoint: str) -> tuple[Client, dict]:
        """The handshake's exchange (no lock needed): a client of its own and the checked
        welcome."""
        client = Client(tp_route.parse(endpoint)[0], self.cfg.max_message_bytes, self._key)
        try:
            hello = wire.encode("hello", fingerprint=self.fingerprint,
                                backend=self._transport.backend)
            reply = client.request(hello, self.cfg.handshake_timeout_s)
            if reply["op"] == "refused":
                mine = self._own_value(reply["field"])
                raise TransferError(f"decode peer {endpoint} refused the handshake "
                                    f"(field '{reply['field']}'): {reply['error']}{mine}")
            fp.check(self.fingerprint, reply["fingerprint"], who="decode peer", hetero_tp=True)
        except BaseException:
            client.close()
            raise
        return client, reply

    def _adopt(self, endpoint: str, client: Client, reply: dict) -> _Peer:
        """Lock held: the welcomed peer joins the transport (or the one that beat it is kept)."""
        if endpoint in self._peers:
            client.close()
            return self._peers[endpoint]
        try:
            layout = StageLayout.from_wire(reply["layout"])
            handle = self._transport.add_peer(reply["transport"], layout)
        except BaseException:
            client.close()
            raise
        self._peers[endpoint] = peer = _Peer(client, layout, handle, reply["incarnation"],
                                             reply["fingerprint"])
        return peer

    def _peer_of(self, endpoint: str, incarnation: str | None, request_id: str) -> _Peer:
        """The handshaken peer at `endpoint`, which must be the receiver that made the
        reservation; a cached peer from before a restart there is handshaken afresh."""
        peer = self._peers.get(endpoint)
        if peer is None:
            raise TransferError(f"decode peer {endpoint} is not connected: it failed or left "
                                f"since the handshake; nothing was sent for {request_id}")
        if incarnation is None or peer.incarnation == incarnation:
            return peer
        self._drop_peer(endpoint, f"decode peer {endpoint} was replaced (new incarnation)")
        peer = self._peer(endpoint)
        if peer.incarnation != incarnation:
            raise TransferError(
                f"destination of {request_id} was reserved on another incarnation of the decode "
                f"worker at {endpoint} (it restarted since); nothing was sent")
        return peer

    def _own_value(self, field_name: str) -> str:
        """This side's value of a refused field (the decode side never shows its own)."""
        if field_name == "backend":
            return f" (this prefill worker uses {self._transport.backend!r})"
        if field_name in self.fingerprint:
            return f" (this prefill worker has {self.fingerprint[field_name]!r})"
        return ""

    def _send_claim(self, ep: str, peer: _Peer, rid: str, slot: int | None, blocks) -> None:
        cid = next(self._next_claim)
        self._grants[ep, rid] = ""
        self._claim_ids[ep, rid] = cid
        peer.client.send(wire.claim(rid, slot, blocks, cid, self.tp.rank if self.tp else 0))

    def _await_grant(self, ep: str, peer: _Peer, rid: str) -> None:
        """The claim's answer, waited for here (a destination nobody claimed ahead)."""
        deadline = time.monotonic() + self.cfg.handshake_timeout_s
        while self._grants.get((ep, rid)) == "" and ep in self._peers:
            left = deadline - time.monotonic()
            if left <= 0 or not peer.client.wait(left):
                raise TransferError(f"decode peer {ep} did not answer the claim on {rid} within "
                                    f"{self.cfg.handshake_timeout_s:g} s "
                                    "(transfer.handshake_timeout_s); nothing was sent")
            self._read(ep, peer)

    def _read(self, ep: str, peer: _Peer) -> None:
        """Messages from a decode stage: grants, denials, bye."""
        for m in peer.client.incoming():
            if m["op"] == "bye":
                self._drop_peer(ep, f"decode peer {ep} closed")
                return
            key = (ep, m["rid"])
            if self._grants.get(key) == "" and self._claim_ids.get(key) == m["cid"]:
                del self._claim_ids[key]
                self._grants[key] = None if m["op"] == "grant" else m["error"]

    def _check_grants(self, rid: str, fl: _InFlight) -> None:
        """Drops the peers that granted from `fl.waiting`; fails the request on a denial."""
        waiting = []
        for peer in fl.waiting:
            ep = self._endpoint_of(peer)
            answer = self._grants.get((ep, rid), "") if ep else "peer dropped"
            if answer:
                self._finish(rid, f"decode peer {ep} refused the write: {answer}")
                return
            if answer == "":
                waiting.append(peer)
        fl.waiting = waiting

    def _endpoint_of(self, peer: _Peer) -> str | None:
        return next((ep for ep, p in self._peers.items() if p is peer), None)

    def _unclaim(self, rid: str, why: str) -> None:
        """A claimed request that will never be sent: its decode stages may reuse it now."""
        claimed = self._claims.pop(rid, None)
        for ep in claimed[1] if claimed else ():
            peer = self._peers.get(ep)
            self._claim_ids.pop((ep, rid), None)
            if self._grants.pop((ep, rid), 1) != 1 and peer is not None:
                peer.client.send(wire.encode("abort", rid=rid, error=why, posted=[]))

    def _drain(self, now: float) -> None:
        keep = []
        for peer, post, until in self._draining:
            if self._transport.check(post)[0] == "PROC" and now < until:
                keep.append((peer, post, until))
            else:
                self._transport.release(post)
        self._draining = keep

    def _post_layers(self, rid: str, fl: _InFlight, layers: set[int],
                     early: bool = True) -> None:
        """`early`: `posted` leaves before the post (its DONE is waited for next), else after
        (layers posted from inside a forward: the first token is drawn meanwhile anyway, and
        the decode side should not start polling while this side's forward still runs)."""
        if fl.waiting:  # posted once every decode stage granted the write
            fl.ready |= layers
            return
        slot, blocks = fl.notify
        for peer, p in fl.plans:
            part = p if layers >= set(p.layers) else p.select(sorted(layers))
            if part.layers and fl.read:
                fl.posts.append((peer, self._transport.read(peer.handle, part)))
            elif part.layers:
                first = id(peer) not in fl.posted
                if first and early:
                    # `posted` wakes the decode side's poller: sent before the post, not after,
                    # because a post is DONE here only once that side's transport progressed
                    # (NIXL/UCX: it acknowledges the notification's flush), so its wake-up
                    # runs while this side posts (a one-block handoff: ~1.0 -> ~0.8 ms)
                    peer.client.send(wire.encode("posted", rid=rid))
                fl.posted.setdefault(id(peer), set()).update(part.layers)
                parts = fl.parts.get(id(peer), {})
                post = self._transport.post(peer.handle, part, wire.landed(
                    rid, part.layers, slot, blocks, self.tp.rank if self.tp else 0,
                    [parts.get(g, 1) for g in part.layers]))
                fl.posts.append((peer, post))
                if first and not early:
                    peer.client.send(wire.encode("posted", rid=rid))  # wakes its poller
        fl.unsent -= layers
        fl.ready -= layers

    def _progress(self, rid: str, fl: _InFlight, now: float) -> None:
        states = [self._transport.check(post) for _, post in fl.posts]
        errors = [err or "transport error" for st, err in states if st == "ERR"]
        if errors:
            broken = [p for (p, _), (st, _) in zip(fl.posts, states, strict=True) if st == "ERR"]
            self._finish(rid, errors[0], broken=broken)
        elif not fl.unsent and all(st == "DONE" for st, _ in states) and now >= fl.hold_until:
            self._finish(rid, None)
        elif now > fl.deadline:
            self._finish(rid, f"lease expired after {self.cfg.lease_seconds:g} s before the "
                              "decode side acknowledged (transfer.lease_seconds)")

    def _finish(self, rid: str, error: str | None, broken: Sequence[_Peer] = ()) -> None:
        fl = self._inflight.pop(rid, None)
        if fl is None:
            return
        until = time.monotonic() + DRAIN_LEASES * self.cfg.lease_seconds
        for peer, post in fl.posts:
            if error is not None and self._transport.check(post)[0] == "PROC":
                self._draining.append((peer, post, until))  # its bytes may still land there
            else:
                self._transport.release(post)
        for ep in [self._endpoint_of(p) for p in fl.peers]:
            self._grants.pop((ep, rid), None)
            self._claim_ids.pop((ep, rid), None)
        if error is not None:
            for peer in fl.peers:
                peer.client.send(wire.encode("abort", rid=rid, error=error,
                                             posted=sorted(fl.posted.get(id(peer), ()))))
            for ep, peer in list(self._peers.items()):
                if any(peer is b for b in broken):
                    self._drop_peer(ep, error)
        elif not fl.read:  # done: nothing more comes from here (frees a quarantine sooner)
            for peer, _ in fl.plans:
                self._outbox.append((peer, wire.encode(
                    "sent", rid=rid, posted=sorted(fl.posted.get(id(peer), ())))))
        self._events.append(TransferEvent(rid, error is None, error))

    def _flush(self) -> None:
        """Sends the queued `sent` messages (to peers still connected)."""
        out, self._outbox = self._outbox, []
        for peer, msg in out:
            if any(p is peer for p in self._peers.values()):
                peer.client.send(msg)

    def _drop_peer(self, endpoint: str, why: str) -> None:
        peer = self._peers.pop(endpoint, None)
        if peer is None:
            return
        for rid, fl in list(self._inflight.items()):
            if any(p is peer for p in fl.peers):
                self._finish(rid, why)
        for d in [d for d in self._draining if d[0] is peer]:
            self._transport.release(d[1])
            self._draining.remove(d)
        for key in [k for k in self._grants if k[0] == endpoint]:
            del self._grants[key]
            self._claim_ids.pop(key, None)
        self._transport.remove_peer(peer.handle)
        peer.client.close()
