"""The two primitives a transport backend provides, and the event both sides report.

A backend (NIXL or UCX) only moves bytes and says when they landed; leases,
handshakes, fingerprints and planning live in `receiver.py` / `sender.py` and
are shared by every backend.

Receiving transport primitives:
    metadata() -> dict        published to senders in the handshake reply
    drain() -> list[bytes]    "landed" notifications whose bytes are all in place
    close()

Sending transport primitives:
    add_peer(meta, layout) -> peer     connect to a receiver from its handshake reply
    post(peer, plan, notif) -> post    start writing `plan`; `notif` reaches the peer after
    check(post) -> (state, error)      state "DONE" | "PROC" | "ERR"
    release(post); remove_peer(peer); close()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

from baton.errors import TransferError
from transfer.layout import StageLayout
from transfer.planner import Plan


class TransferEvent(NamedTuple):
    request_id: str
    ok: bool
    """True: the bytes landed (receiver) / were delivered (sender)."""
    error: str | None = None
    """Why it failed, expired or was aborted; None when ok."""
    quarantined: bool = False
    """Receiver, failed: a granted sender may still write into the reservation; its blocks
    stay out of service until the receiver's `on_release` names the request."""


class RecvTransport(ABC):
    backend: str

    @abstractmethod
    def metadata(self) -> dict: ...

    @abstractmethod
    def drain(self) -> list[bytes]: ...

    @abstractmethod
    def close(self) -> None: ...


class SendTransport(ABC):
    backend: str

    @abstractmethod
    def add_peer(self, meta: dict, layout: StageLayout) -> object: ...

    @abstractmethod
    def remove_peer(self, peer: object) -> None: ...

    @abstractmethod
    def post(self, peer: object, plan: Plan, notif: bytes) -> object: ...

    def read(self, peer: object, plan: Plan) -> object:
        """One-sided READ of the plan's peer units into the local ones (a decode worker's
        snapshot pulled back into this prefill worker); `check` / `release` as for `post`."""
        raise TransferError(f"the {self.backend!r} transfer backend cannot pull a snapshot "
                            "back from a decode worker; use transfer.backend: nixl")

    @abstractmethod
    def check(self, post: object) -> tuple[str, str | None]: ...

    @abstractmethod
    def release(self, post: object) -> None: ...

    @abstractmethod
    def close(self) -> None: ...
