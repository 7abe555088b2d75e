"""Decode side of one stage: answers handshakes, tracks leased destinations, reports events.

Life of a transfer on the decode side:
  1. the worker reserves blocks + a live slot, then `expect(rid, blocks, slot, lease_s)`;
  2. each prefill sender `claim`s the reservation before it writes a byte and is granted it
     only while it is expected here: once a reservation failed, no new write can start;
  3. granted senders write into it and each sends a `landed` notification naming the
     global layers it covered (one per prefill stage whose layers meet this stage's);
  4. `poll()` reports `TransferEvent(rid, True)` once every layer of this stage landed,
     or `(rid, False, why)` on abort by the sender, `abort()` here, or lease expiry;
     either way the worker then frees (failure) or adopts (success) the blocks.

Quarantine. A one-sided write cannot be recalled: bytes a granted sender posted may still be
on the wire when the request fails here (a link that went down mid-transfer delivers them
when it comes back). So a failed reservation that was granted is reported with
`quarantined=True`: the worker must keep its blocks and slot out of service until
`on_release(rid)` is called, which happens only when nothing more can land there:
  * every layer the granted senders posted has landed (the notification follows the data);
  * or each granted sender said which layers it posted (abort `posted`) and those landed,
    ([] = it never wrote: released at once);
  * or a granted sender's side-channel connection closed (its process exited or closed the
    endpoint; its host's kernel closed the UCX sockets with it) and QUARANTINE_GRACE_S passed.
A link that stays down releases nothing: the blocks stay out of service, counted
(`quarantined`), and are returned if the writes complete after all.
The receiver never frees anything itself: the worker's cache manager owns the blocks.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from baton.config.transfer import TransferConfig
from baton.errors import TransferError
from baton.model.pools import Pools
from transfer import fingerprint as fp
from transfer import wire
from transfer.base import RecvTransport, TransferEvent
from transfer.layout import StageLayout
from transfer.side_channel import Listener

log = logging.getLogger("baton.transfer")

_MAX_EARLY = 4096
"""Notifications kept for requests not expected yet (bounded against a runaway peer)."""
WATCH_INTERVAL_S = 0.0002
"""Poll interval while a sender said its writes are under way: the landing is due any moment."""
QUARANTINE_GRACE_S = 2.0
"""After a granted sender's side-channel connection closed: how long its host may still take
to deliver bytes it had already sent (a few TCP retransmissions on a working link)."""
WAIT_INTERVAL_S = 0.05
"""Poll interval while destinations are reserved but nothing was posted yet (leases, early
notifications); a lost `posted` message costs at most this much latency."""
SOURCE_INTERVAL_S = 0.0005
"""Poll interval while local blocks are held as the source of a peer's one-sided READ (a
decode-end snapshot being pulled back): without progress calls here the transport serves the
read only at the next housekeeping tick (a second)."""


@dataclass
class _Expected:
    blocks: frozenset[int]
    slot: int | None
    deadline: float
    lease_s: float
    pending: set[int] = field(default_factory=set)
    """Global layers not yet landed."""
    writers: dict[bytes, set[int] | None] = field(default_factory=dict)
    """Granted senders (side-channel identity) -> the layers they said they posted here
    (None: not said yet, any layer may still land)."""
    parts: dict[int, set[int]] = field(default_factory=dict)
    """Layer -> the source TP ranks whose share of it landed (a layer written by several
    tensor-parallel prefill ranks is complete once all of them did: `landed.parts`)."""
    src: dict[bytes, int] = field(default_factory=dict)
    """Granted senders -> their TP rank (what their `landed` names)."""

    def landed(self, msg: dict) -> None:
        _landed(self, msg)


def _landed(e, msg: dict) -> None:
    for g, k in zip(msg["layers"], msg["parts"], strict=True):
        got = e.parts.setdefault(g, set())
        got.add(msg["src"])
        if len(got) >= k:
            e.pending.discard(g)


@dataclass
class Quarantined:
    """A failed reservation whose blocks may still be written (see the module doc)."""

    key: str
    """Unique among held quarantines (the request id, suffixed if that one is held twice)."""
    rid: str
    blocks: frozenset[int]
    slot: int | None
    since: float
    pending: set[int]
    writers: dict[bytes, set[int] | None]
    gone: dict[bytes, float] = field(default_factory=dict)
    """Writers whose connection closed -> when."""
    parts: dict[int, set[int]] = field(default_factory=dict)
    src: dict[bytes, int] = field(default_factory=dict)
    """As on `_Expected`: which writer's share of each layer landed."""

    def landed(self, msg: dict) -> None:
        _landed(self, msg)

    def _writer_done(self, ident: bytes, posted: set[int]) -> bool:
        """Every layer the writer posted here landed (its own share of it)."""
        me = self.src.get(ident, 0)
        return all(g not in self.pending or me in self.parts.get(g, ()) for g in posted)

    def safe(self, now: float) -> bool:
        return self.why_safe(now) is not None

    def why_safe(self, now: float) -> str | None:
        """Why nothing more can land in these blocks, or None while something may."""
        if not self.pending:
            return "every layer landed"
        why = set()
        for ident, posted in self.writers.items():
            if posted is not None and self._writer_done(ident, posted):
                why.add("what the writer posted landed" if posted else "nothing was posted")
                continue
            t = self.gone.get(ident)
            if t is None or now - t < QUARANTINE_GRACE_S:
                return None
            why.add(f"the writer's connection closed {QUARANTINE_GRACE_S:g} s ago")
        return "; ".join(sorted(why))


class Receiver:
    """Thread-safe: one lock guards the transport and the lease table."""

    def __init__(self, cfg: TransferConfig, pools: Pools, fingerprint: dict, bind_host: str,
                 transport_cls: type[RecvTransport], key: bytes | None = None):
        self.cfg = cfg
        self.layout = StageLayout.from_pools(pools)
        self.fingerprint = fingerprint
        self.incarnation = secrets.token_hex(8)
        """Random id of this receiver: reservations name it, senders check it at handshake."""
        self._lock = threading.Lock()
        self._expected: dict[str, _Expected] = {}
        self._early: dict[str, tuple[float, list[dict]]] = {}
        self._events: list[TransferEvent] = []
        self._posted: set[str] = set()
        """Expected requests whose sender said it started writing (poll fast)."""
        self._quarantine: dict[str, Quarantined] = {}
        """Quarantine key -> entry."""
        self._held: dict[str, str] = {}
        """Request id -> key of its latest quarantine."""
        self._released: list[str] = []
        self._sources: set[str] = set()
        """Requests whose local blocks are held for a peer to READ (`serve_reads`)."""
        self._gone: dict[bytes, float] = {}
        """Senders whose side-channel connection closed -> when (a reservation they were
        granted may fail after that)."""
        self.quarantined_total = 0
        """Failed reservations ever quarantined (each returned once released)."""
        self.on_activity: Callable[[], None] | None = None
        """Called (listener thread) when a sender starts writing: poll fast now."""
        self.on_release: Callable[[str], None] | None = None
        """Called (polling thread, no lock held) with a quarantine's key once nothing more can
        land in its blocks: the worker frees them then."""
        self._transport = transport_cls(cfg, pools, bind_host, self._authorize)
        self._welcome = None
        self._listener = Listener(bind_host, cfg.max_message_bytes, self._on_message, key,
                                  cfg.side_channel_ports)
        from transfer.tp_route import annotate

        self.endpoint = annotate(self._listener.endpoint, fingerprint.get("tp_rank", 0),
                                 fingerprint.get("tp_size", 1))
        """`tcp://host:port` of the side channel, handed to prefill workers (a rank of a
        tensor-parallel worker adds its place, `#tp=RANK/SIZE`: transfer/tp_route.py)."""

    def expect(self, request_id: str, block_ids: list[int], slot: int | None,
               lease_s: float | None = None) -> None:
        """Destination reserved for `request_id`; it is leased for `lease_s` seconds."""
        lease = self.cfg.lease_seconds if lease_s is None else lease_s
        with self._lock:
            if request_id in self._expected:
                raise TransferError(f"request {request_id!r} is already expected")
            e = _Expected(frozenset(int(b) for b in block_ids), slot, time.monotonic() + lease,
                          lease, set(self.layout.layers))
            self._expected[request_id] = e
            for msg in self._early.pop(request_id, (0.0, []))[1]:
                self._apply(request_id, msg)
            self._finish_if_done(request_id)

    def abort(self, request_id: str, reason: str = "aborted by the decode worker") -> None:
        with self._lock:
            self._fail(request_id, reason)

    def held(self, request_id: str) -> Quarantined | None:
        """The quarantine of a failed reservation whose blocks may still be written, or None
        (never granted, released, or unknown): the worker keeps these blocks out of service."""
        with self._lock:
            key = self._held.get(request_id)
            return None if key is None else self._quarantine.get(key)

    @property
    def quarantined(self) -> dict[str, Quarantined]:
        with self._lock:
            return dict(self._quarantine)

    def poll(self) -> list[TransferEvent]:
        """Completed, failed and expired requests since the last call."""
        out = self._poll()
        with self._lock:
            released, self._released = self._released, []
        for rid in released:
            if self.on_release is not None:
                self.on_release(rid)
        return out

    def _poll(self) -> list[TransferEvent]:
        with self._lock:
            for data in self._transport.drain():
                self._on_landed(data)
            now = time.monotonic()
            for rid, e in list(self._expected.items()):
                if now > e.deadline:
                    self._fail(rid, f"lease expired after {e.lease_s:g} s with layers "
                                    f"{sorted(e.pending)} not landed (transfer.lease_seconds)")
            for rid, (t, _) in list(self._early.items()):
                if now - t > self.cfg.lease_seconds:
                    del self._early[rid]
            for key, q in list(self._quarantine.items()):
                why = q.why_safe(now)
                if why:
                    # its writer said it is done: routine; after the grace: worth a word
                    log.log(logging.WARNING if "connection closed" in why else logging.INFO,
                            "quarantine %s released after %.1f s: %s", key, now - q.since, why)
                    self._release(key)
            out, self._events = self._events, []
            return out

    def poll_interval(self) -> float | None:
        """How soon `poll()` should run again; None: nothing to watch until woken."""
        with self._lock:
            if self._posted:
                return WATCH_INTERVAL_S
            if self._sources:
                return SOURCE_INTERVAL_S
            busy = self._expected or self._early or self._quarantine or self._released
            return WAIT_INTERVAL_S if busy else None

    def serve_reads(self, request_id: str, held: bool) -> None:
        """`request_id`'s blocks are (held=True) or no longer are the source of a peer's
        one-sided READ: poll often meanwhile, so that the transport serves it."""
        with self._lock:
            if held:
                self._sources.add(request_id)
            else:
                self._sources.discard(request_id)
        if held and self.on_activity is not None:
            self.on_activity()

    @property
    def pending(self) -> list[str]:
        with self._lock:
            return sorted(self._expected)

    def tracked(self) -> dict[str, int]:
        """Per-request bookkeeping sizes (worker Stats `tracked_*`; quarantines are counted
        by the cache stats)."""
        with self._lock:
            return {"receiver_expected": len(self._expected), "receiver_early": len(self._early),
                    "receiver_posted": len(self._posted), "receiver_events": len(self._events)}

    def close(self) -> None:
        self._listener.close()
        self._transport.close()  # not under the lock: a UCX loop may be waiting in _authorize

    # -- internals (lock held unless noted) ------------------------------------------------

    def _on_landed(self, data: bytes) -> None:
        try:
            msg = wire.decode(data, self.cfg.max_message_bytes, ops=("landed",))
            wire.landed_blocks(msg)
        except TransferError:
            return  # a notification we cannot read names no request we could fail
        rid, blocks = msg["rid"], wire.landed_blocks(msg)
        e = self._expected.get(rid)
        if rid in self._held and (e is None or self._check(e, msg["slot"], blocks)):
            for q in self._quarantine.values():  # late bytes of a failed transfer
                if q.rid == rid and not self._check(q, msg["slot"], blocks):
                    q.landed(msg)
                    return
        if rid not in self._expected:
            if len(self._early) < _MAX_EARLY:
                self._early.setdefault(rid, (time.monotonic(), []))[1].append(msg)
            return
        self._apply(rid, msg)
        self._finish_if_done(rid)

    def _apply(self, rid: str, msg: dict) -> None:
        e = self._expected[rid]
        err = self._check(e, msg["slot"], wire.landed_blocks(msg))
        if err:
            self._fail(rid, err)
        else:
            e.landed(msg)

    def _check(self, e: _Expected | Quarantined, slot: int | None, blocks: np.ndarray) -> str | None:
        stray = set(blocks.tolist()) - e.blocks if self.layout.kv else set()
        if stray:
            return f"sender wrote blocks {sorted(stray)[:8]} that were not reserved"
        if self.layout.state and e.slot is not None and slot != e.slot:
            return f"sender wrote slot {slot}, reserved slot is {e.slot}"
        return None

    def _authorize(self, rid: str, slot: int | None, blocks: np.ndarray) -> str | None:
        """For two-sided backends, before bytes land: None if allowed, else why not."""
        with self._lock:
            e = self._expected.get(rid)
            return f"request {rid!r} is not expected" if e is None else self._check(e, slot, blocks)

    def _finish_if_done(self, rid: str) -> None:
        e = self._expected.get(rid)
        if e is not None and not e.pending:
            del self._expected[rid]
            self._posted.discard(rid)
            self._events.append(TransferEvent(rid, True, None))

    def _fail(self, rid: str, why: str) -> None:
        self._posted.discard(rid)
        e = self._expected.pop(rid, None)
        if e is None:
            return
        key = rid if rid not in self._quarantine else f"{rid}#{self.quarantined_total}"
        q = Quarantined(key, rid, e.blocks, e.slot, time.monotonic(), set(e.pending),
                        dict(e.writers), {i: self._gone[i] for i in e.writers if i in self._gone},
                        {g: set(s) for g, s in e.parts.items()}, dict(e.src))
        held = bool(q.writers) and not q.safe(q.since)
        if held:
            self._quarantine[key] = q
            self._held[rid] = key
            self.quarantined_total += 1
        self._events.append(TransferEvent(rid, False, why, held))

    def _release(self, key: str) -> None:
        q = self._quarantine.pop(key, None)
        if q is not None:
            if self._held.get(q.rid) == key:
                del self._held[q.rid]
            self._released.append(key)

    def _abort_from(self, ident: bytes, msg: dict) -> None:
        """A sender gave the request up, saying which layers it had posted here."""
        rid, posted = msg["rid"], {g for g in msg["posted"] if isinstance(g, int)}
        e = self._expected.get(rid)
        if e is not None:
            if ident in e.writers:
                e.writers[ident] = posted
            self._fail(rid, f"aborted by prefill: {msg['error']}")
            return
        for q in self._quarantine.values():
            if q.rid == rid and ident in q.writers and q.writers[ident] is None:
                q.writers[ident] = posted  # released by the next poll if that was all

    def _sent_from(self, ident: bytes, msg: dict) -> None:
        """A writer's transfer completed on its side: it will write nothing more, so a
        quarantine waiting on it needs only what it posted to land (a pipeline-parallel
        prefill's other writers may never write: a stage that finished says so here, one that
        gave up says so in its abort)."""
        rid, posted = msg["rid"], {g for g in msg["posted"] if isinstance(g, int)}
        e = self._expected.get(rid)
        if e is not None and e.writers.get(ident, 1) is None:
            e.writers[ident] = posted  # before a failure: its quarantine starts knowing it
            return
        for q in self._quarantine.values():
            if q.rid == rid and ident in q.writers and q.writers[ident] is None:
                q.writers[ident] = posted  # released by the next poll if that was all

    def _claim(self, ident: bytes, msg: dict) -> bytes:
        rid, cid = msg["rid"], msg["cid"]
        e = self._expected.get(rid)
        if e is None:
            return wire.encode("deny", rid=rid, cid=cid, error=(
                f"the reservation of {rid} is no longer held here (lease expired or aborted); "
                "nothing may be written into it"))
        try:
            err = self._check(e, msg["slot"], wire.landed_blocks(msg))
        except TransferError as ex:
            err = str(ex)
        if err:
            return wire.encode("deny", rid=rid, cid=cid, error=err)
        e.writers.setdefault(ident, None)
        e.src[ident] = msg["src"]
        return wire.encode("grant", rid=rid, cid=cid)

    def _peer_gone(self, ident: bytes) -> None:
        """A sender's side-channel connection closed."""
        now = time.monotonic()
        if len(self._gone) >= _MAX_EARLY:
            del self._gone[next(iter(self._gone))]  # the oldest
        self._gone[ident] = now
        for q in self._quarantine.values():
            if ident in q.writers:
                q.gone.setdefault(ident, now)

    def _on_message(self, ident: bytes, msg: dict) -> bytes | None:
        """Side-channel handler (listener thread)."""
        if msg["op"] == "abort":
            with self._lock:
                self._abort_from(ident, msg)
            return None
        if msg["op"] == "sent":
            with self._lock:
                self._sent_from(ident, msg)
            if self.on_activity is not None:
                self.on_activity()
            return None
        if msg["op"] == "gone":
            with self._lock:
                self._peer_gone(ident)
            return None
        if msg["op"] == "claim":
            with self._lock:
                return self._claim(ident, msg)
        if msg["op"] == "posted":
            with self._lock:
                known = msg["rid"] in self._expected
                if known:
                    self._posted.add(msg["rid"])
            if known and self.on_activity is not None:
                self.on_activity()
            return None
        # a refusal names the field only: it never shows this worker's own values to a peer
        if msg["backend"] != self._transport.backend:
            return wire.encode("refused", field="backend", error=(
                "incompatible peer: fingerprint field 'backend' differs from this decode "
                "worker's; set transfer.backend the same on both"))
        # TP sizes may differ: each side's declared shard layout is checked, and the sender
        # plans its ranks' pieces against this rank's (transfer/tp_route.py)
        diff = fp.mismatch(self.fingerprint, msg["fingerprint"], hetero_tp=True)
        if diff is not None:
            return wire.encode("refused", field=diff[0], error=(
                f"incompatible peer: fingerprint field '{diff[0]}' differs from this decode "
                "worker's; prefill and decode must run the same model, dtype and cache settings"))
        if self._welcome is None:
            self._welcome = wire.encode("welcome", layout=self.layout.to_wire(),
                                        fingerprint=self.fingerprint,
                                        transport=self._transport.metadata(),
                                        incarnation=self.incarnation)
        return self._welcome
