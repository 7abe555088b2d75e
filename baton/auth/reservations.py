"""Reservations are capabilities: the decode worker signs each one, the prefill worker verifies.

With one-sided NIXL WRITE the decode side cannot check after the fact, so the prefill worker
refuses, before it computes or moves a byte, any destination that its decode worker did not
issue exactly as given: other blocks, another slot, a longer lease, another endpoint or
incarnation, or another request id all break the signature.
"""

from __future__ import annotations

import json
from dataclasses import replace

from baton.auth.secret import ClusterSecret
from baton.contract import Reservation
from baton.errors import NotPermittedError

PURPOSE = "reservation"


def signed_bytes(request_id: str, r: Reservation) -> bytes:
    """What the signature covers, in a fixed order (JSON: deterministic for these types)."""
    fields = [1, request_id, r.worker_id, r.transfer_endpoint, [int(b) for b in r.block_ids],
              r.slot, int(r.skip_blocks), float(r.lease_seconds), r.incarnation]
    return json.dumps(fields, separators=(",", ":")).encode()


def sign_reservation(secret: ClusterSecret | None, request_id: str, r: Reservation) -> Reservation:
    """`r` with its signature (unchanged without a secret)."""
    if secret is None:
        return r
    return replace(r, signature=secret.sign(PURPOSE, signed_bytes(request_id, r)))


def verify_reservation(secret: ClusterSecret | None, request_id: str, r: Reservation) -> None:
    """NotPermittedError unless `r` is exactly as its decode worker issued it for `request_id`."""
    if secret is None:
        return
    if not r.signature:
        raise NotPermittedError(
            f"destination of request {request_id} carries no signature; only a reservation "
            "made by a decode worker of this cluster (DecodeWorker.Reserve) can be written to"
        )
    if not secret.verify(PURPOSE, signed_bytes(request_id, r), r.signature):
        raise NotPermittedError(
            f"destination of request {request_id} does not match its signature: it was "
            "altered, made for another request, or signed with another cluster secret; "
            "nothing was written"
        )
