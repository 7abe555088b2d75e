"""ZeroMQ side channel: the decode side's listener thread and the prefill side's client.

    prefill Sender ── DEALER ──tcp──► ROUTER  Listener thread (decode Receiver)
                     hello  ───────►  handler(msg) -> welcome | refused
                     abort  ───────►  handler(msg) -> None (no reply)
                     posted ───────►  handler(msg) -> None (no reply)
                            ◄───────  bye (on close, to every peer that said hello)

The listener owns its socket in its own thread; the client is used only under
its owner's lock. Oversized messages are dropped by ZeroMQ (MAXMSGSIZE) and
everything else malformed is answered with `refused` while the loop keeps going.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from baton.errors import TransferError
from transfer import wire

log = logging.getLogger(__name__)

Handler = Callable[[bytes, dict], bytes | None]
"""(peer identity, decoded message) -> reply bytes or None."""


class Listener:
    """ROUTER socket bound to `tcp://host:<free port>`, served by a daemon thread."""

    def __init__(self, host: str, max_bytes: int, handler: Handler):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._max = max_bytes
        self._handler = handler
        self._peers: set[bytes] = set()
        self._stop = threading.Event()
        self.rejected = 0
        """Messages refused as malformed (for tests and logs)."""
        self._thread = threading.Thread(target=self._run, name="baton-side-channel", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(50, zmq.POLLIN):
                    self._serve_one()
            for ident in self._peers:
                self._sock.send_multipart([ident, wire.encode("bye")], zmq.NOBLOCK)
        except Exception:  # the loop must outlive anything a peer sends
            log.exception("side-channel listener stopped")
        finally:
            self._sock.close(0)

    def _serve_one(self) -> None:
        frames = self._sock.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 2:
            self.rejected += 1
            return
        ident, data = frames
        try:
            msg = wire.decode(data, self._max, ops=("hello", "abort", "posted"))
            reply = self._handler(ident, msg)
            if msg["op"] == "hello" and len(self._peers) < 1024:
                self._peers.add(ident)
        except TransferError as e:
            self.rejected += 1
            reply = wire.encode("refused", error=str(e), field="message")
        except Exception as e:
            self.rejected += 1
            log.exception("side-channel handler failed")
            reply = wire.encode("refused", error=f"internal error: {e}", field="message")
        if reply is not None:
            self._sock.send_multipart([ident, reply], zmq.NOBLOCK)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()


class Client:
    """DEALER socket to one receiver's endpoint."""

    def __init__(self, endpoint: str, max_bytes: int):
        self.endpoint = endpoint
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self._max = max_bytes
        self._sock.connect(endpoint)

    def request(self, data: bytes, timeout_s: float) -> dict:
        """Send and wait for the reply (welcome / refused); TransferError on timeout."""
        self._sock.send(data)
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TransferError(f"no handshake reply from {self.endpoint} within {timeout_s} s; "
                                "is the decode worker up? (transfer.handshake_timeout_s)")
        return wire.decode(self._sock.recv(), self._max, ops=("welcome", "refused"))

    def send(self, data: bytes) -> None:
        try:
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            pass  # best effort: the peer's lease covers a lost abort

    def incoming(self) -> list[dict]:
        """Unsolicited messages (bye) waiting on the socket; malformed ones are skipped."""
        out = []
        while self._sock.poll(0, zmq.POLLIN):
            try:
                out.append(wire.decode(self._sock.recv(), self._max, ops=("bye",)))
            except TransferError as e:
                log.warning("ignoring malformed message from %s: %s", self.endpoint, e)
        return out

    def close(self) -> None:
        self._sock.close(0)
