"""ZeroMQ side channel: the decode side's listener thread and the prefill side's client.

    prefill Sender ── DEALER ──tcp──► ROUTER  Listener thread (decode Receiver)
                     hello  ───────►  handler(msg) -> welcome | refused
                     abort  ───────►  handler(msg) -> None (no reply)
                     claim  ───────►  handler(msg) -> grant | deny
                     posted ───────►  handler(msg) -> None (no reply)
                            ◄───────  bye (on close, to every peer that said hello)
                  (disconnect)   ──►  handler(ident, {"op": "gone"}) (the peer's connection
                                      closed: its process closed the socket or exited)

The listener owns its socket in its own thread; the client is used only under
its owner's lock. Oversized messages are dropped by ZeroMQ (MAXMSGSIZE) and
everything else malformed is answered with `refused` while the loop keeps going.
With a key (the cluster secret's side-channel key) every frame is sealed both ways
(transfer/wire.py: seal); a frame whose MAC does not verify is dropped unread and
unanswered, so an outsider learns nothing, not even that the message was malformed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from baton.config.ports import ANY_PORT, PortRange
from baton.errors import TransferError
from transfer import wire

log = logging.getLogger(__name__)

Handler = Callable[[bytes, dict], bytes | None]
"""(peer identity, decoded message) -> reply bytes or None."""


class Listener:
    """ROUTER socket bound to `tcp://host:<port>` (the first free one of `ports`; any free one
    by default), served by a daemon thread."""

    def __init__(self, host: str, max_bytes: int, handler: Handler, key: bytes | None = None,
                 ports: PortRange = ANY_PORT):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        if ports.any:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            port = ports.bind(lambda p: _bind(self._sock, host, p), "transfer.side_channel_port")
        self.endpoint = f"tcp://{host}:{port}"
        self._max = max_bytes
        self._handler = handler
        self._key = key
        self._peers: set[bytes] = set()
        self._fds: dict[int, set[bytes]] = {}
        """Connection (file descriptor) -> the peer identities heard on it, to tell the handler
        which peers are gone when ZeroMQ's monitor reports that connection closed."""
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._stop = threading.Event()
        self.rejected = 0
        """Messages refused as malformed (for tests and logs)."""
        self.unauthenticated = 0
        """Frames dropped because their MAC did not verify."""
        self._thread = threading.Thread(target=self._run, name="baton-side-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(50))
                if self._sock in ready:
                    self._serve_one()
                if self._monitor in ready:
                    self._disconnected()
            for ident in self._peers:
                self._sock.send_multipart([ident, wire.seal(wire.encode("bye"), self._key)],
                                          zmq.NOBLOCK)
        except Exception:  # the loop must outlive anything a peer sends
            log.exception("side-channel listener stopped")
        finally:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)

    def _disconnected(self) -> None:
        event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return
        for ident in self._fds.pop(event["value"], ()):
            self._peers.discard(ident)
            try:
                self._handler(ident, {"op": "gone"})
            except Exception:
                log.exception("side-channel disconnect handler failed")

    def _serve_one(self) -> None:
        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        if len(frames) != 2:
            self.rejected += 1
            return
        ident, data = frames[0].bytes, frames[1].bytes
        fd = frames[1].get(zmq.SRCFD)
        try:
            data = wire.unseal(data, self._key)
        except wire.Unauthenticated:
            self.unauthenticated += 1
            if self.unauthenticated in (1, 10, 100) or self.unauthenticated % 1000 == 0:
                log.warning("side channel %s dropped %d unauthenticated message(s); do all "
                            "workers share the cluster secret?", self.endpoint,
                            self.unauthenticated)
            return
        try:
            msg = wire.decode(data, self._max, ops=("hello", "abort", "claim", "posted", "sent"))
            if len(self._fds) < 4096:
                self._fds.setdefault(fd, set()).add(ident)
            reply = self._handler(ident, msg)
            if msg["op"] == "hello" and len(self._peers) < 1024:
                self._peers.add(ident)
        except TransferError as e:
            self.rejected += 1
            reply = wire.encode("refused", error=str(e), field="message")
        except Exception:
            self.rejected += 1
            log.exception("side-channel handler failed")
            reply = wire.encode("refused", error="internal error (see the decode worker's log)",
                                field="message")
        if reply is not None:
            self._sock.send_multipart([ident, wire.seal(reply, self._key)], zmq.NOBLOCK)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    try:
        sock.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as e:
        raise OSError(e.errno, f"tcp://{host}:{port}: {e}") from None
    return port


class Client:
    """DEALER socket to one receiver's endpoint."""

    def __init__(self, endpoint: str, max_bytes: int, key: bytes | None = None):
        self.endpoint = endpoint
        self._key = key
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self._max = max_bytes
        self._sock.connect(endpoint)

    def request(self, data: bytes, timeout_s: float) -> dict:
        """Send and wait for the reply (welcome / refused); TransferError on timeout."""
        self._sock.send(wire.seal(data, self._key))
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TransferError(f"no handshake reply from {self.endpoint} within {timeout_s} s; "
                                "is the decode worker up, and does it hold the same cluster "
                                "secret? (transfer.handshake_timeout_s)")
        try:
            reply = wire.unseal(self._sock.recv(), self._key)
        except wire.Unauthenticated as e:
            raise TransferError(f"the handshake reply from {self.endpoint} is not authenticated "
                                f"({e}); prefill and decode must share the cluster secret") from None
        return wire.decode(reply, self._max, ops=("welcome", "refused"))

    def send(self, data: bytes) -> None:
        try:
            self._sock.send(wire.seal(data, self._key), zmq.NOBLOCK)
        except zmq.Again:
            pass  # best effort: the peer's lease covers a lost abort

    def wait(self, timeout_s: float) -> bool:
        """Whether a message arrived within `timeout_s` (read it with `incoming`)."""
        return bool(self._sock.poll(int(timeout_s * 1000), zmq.POLLIN))

    def incoming(self) -> list[dict]:
        """Messages waiting on the socket (bye, grant, deny); malformed ones are skipped."""
        out = []
        while self._sock.poll(0, zmq.POLLIN):
            try:
                data = wire.unseal(self._sock.recv(), self._key)
                out.append(wire.decode(data, self._max, ops=("bye", "grant", "deny")))
            except TransferError as e:
                log.warning("ignoring malformed message from %s: %s", self.endpoint, e)
        return out

    def close(self) -> None:
        self._sock.close(0)
