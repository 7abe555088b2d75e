"""PullSnapshot: a decode worker's decode-end state pulled back into this prefill worker.

    pull(tokens, source)                     source: the decode worker's signed HoldSnapshot
      verify the source's signature          nothing moves for a forgery
      cache.admit_pull(tokens)               on the loop thread: blocks for the tokens (the
                                             leading ones held here are shared, not read)
                                             and a live slot
      sender.send(read=True)                 one-sided READ of the held blocks and state slot
                                             into them, through the transfer layer
      landed: cache.adopt                    committed as this worker's own snapshot (its
                                             insert event reaches the router by heartbeat)
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
            sender.connect(src.transfer_endpoint)
            sender.send(rid, src.transfer_endpoint, list(blocks),
                        adm.slot if pools.has_state else None, list(src.block_ids), src.slot,
                        skip_blocks=skip, incarnation=src.incarnation or None, read=True)
            events.wake()
            ev = events.wait(rid, src.lease_seconds)
            if ev is None or not ev.ok:
                why = "did not finish within its lease" if ev is None else ev.error
                raise TransferError(f"pulling snapshot {rid} from {src.worker_id}: {why}")
            ok = True
            if loop.call(cache.adopt, rid, tokens):
                self.adopted += 1
            return len(blocks) - skip
        finally:
            if not ok:
                sender.abort(rid, "the prefill worker gave up pulling the snapshot")
                events.forget(rid)
                loop.call(cache.abort, rid)
