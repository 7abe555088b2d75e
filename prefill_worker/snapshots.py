"""PullSnapshot: a decode worker's decode-end state pulled back into this prefill worker.

    pull(tokens, source)                     source: the decode worker's signed HoldSnapshot
      verify the source's signature          nothing moves for a forgery
      cache.admit_pull(tokens)               on the loop thread: blocks for the tokens (the
                                             leading ones held here are shared, not read)
                                             and a live slot (and a 16-bit staging slot
                                             when the source holds the state in its
                                             snapshot pool: docs/state-precision.md)
      sender.send(read=True)                 one-sided READ of the held blocks and state slot
                                             into them, through the transfer layer
      landed: cache.adopt                    committed as this worker's own snapshot (its
                                             insert event reaches the router by heartbeat;
                                             a staged state is widened first)
      failed: release                        nothing committed
"""

from __future__ import annotations

import logging

from baton.auth import ClusterSecret
from baton.auth.reservations import verify_reservation
from baton.contract import SnapshotShipment
from baton.errors import SnapshotGone, TransferError

log = logging.getLogger("baton.prefill")


class SnapshotPulls:
    def __init__(self, service, secret: ClusterSecret | None):
        self.service, self.secret = service, secret
        self.adopted = 0
        self.pulled = 0
        """Pulls whose bytes landed (Stats `snapshots_pulled`)."""
        self.state_bytes = 0
        """State bytes read by pulls (Stats `pulled_state_bytes_total`; half the float32
        ones when the state moved in 16 bits)."""

    def pull(self, s: SnapshotShipment) -> int:
        """Returns the KV blocks read; raises TransferError, NotPermittedError."""
        rid, src = s.request_id, s.source
        verify_reservation(self.secret, rid, src)
        loop, sender, events = self.service.loop, self.service.sender, self.service.events
        if len(src.endpoints) > 1 or getattr(loop.engine.model, "size", 1) > 1:
            # every prefill stage would READ its layers from every decode stage: not built yet
            raise SnapshotGone(f"snapshot {rid} not pulled: pulling between pipeline- or tensor-parallel "
                               "workers is not supported yet (the next turn recomputes it)")
        cache, pools = loop.engine.cache, loop.engine.pools
        tokens = list(s.token_ids)
        adm = loop.call(cache.admit_pull, rid, tokens)
        ok = False
        try:
            blocks = adm.block_table if pools.has_kv else []
            if len(blocks) != len(src.block_ids):
                raise TransferError(f"source of {rid} has {len(src.block_ids)} blocks for "
                                    f"{len(tokens)} tokens, this worker needs {len(blocks)}")
            skip = adm.cached_tokens // pools.spec.tokens_per_block if pools.has_kv else 0
            peer = sender.connect(src.transfer_endpoint)
            slot = adm.slot if pools.has_state else None
            if slot is not None and _snapshot_slot(peer, src.slot):  # held in 16 bits there
                slot = loop.call(cache.stage, rid)
                if slot is None:
                    raise TransferError(f"snapshot {rid} is held in 16 bits but this worker has "
                                        "no snapshot slot to stage it in (raise "
                                        "cache.num_state_slots)")
            sender.send(rid, src.transfer_endpoint, list(blocks), slot, list(src.block_ids),
                        src.slot, skip_blocks=skip, incarnation=src.incarnation or None,
                        read=True)
            events.wake()
            ev = events.wait(rid, src.lease_seconds)
            if ev is None or not ev.ok:
                why = "did not finish within its lease" if ev is None else ev.error
                raise TransferError(f"pulling snapshot {rid} from {src.worker_id}: {why}")
            ok = True
            self.pulled += 1
            if slot is not None:
                self.state_bytes += len(peer.state.layers) * peer.state_slot_bytes(src.slot)
            if loop.call(cache.adopt, rid, tokens):
                self.adopted += 1
            return len(blocks) - skip
        finally:
            if not ok:
                sender.abort(rid, "the prefill worker gave up pulling the snapshot")
                events.forget(rid)
                loop.call(cache.abort, rid)


def _snapshot_slot(layout, slot: int | None) -> bool:
    """Whether `slot` is a snapshot-pool (16-bit) slot of the peer's `layout`."""
    st = layout.state if layout is not None else None
    return st is not None and slot is not None and slot >= st.num_slots
