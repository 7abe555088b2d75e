"""Baton's transfer layer: moves a request's KV blocks and recurrent state, prefill -> decode.

Facade for single-stage workers (one Receiver / Sender per stage process):

    from transfer import make_receiver, make_sender, compute_fingerprint

    fingerprint = compute_fingerprint(model_cfg, pools.spec)       # same on both sides

    key = secret.key(SIDE_CHANNEL)   # None without a cluster secret: unsealed side channel

    # decode side
    receiver = make_receiver(cfg, pools, fingerprint, bind_host="127.0.0.1", key=key)
    receiver.endpoint                    # "tcp://host:port", handed to prefill workers
    receiver.expect(rid, block_ids, slot, lease_s)   # destination reserved and leased
    receiver.poll() -> [TransferEvent(rid, ok, error)]   # landed / aborted / lease expired
    receiver.abort(rid)                  # give up early; reported by the next poll()
    receiver.close()

    # prefill side
    sender = make_sender(cfg, pools, fingerprint, key=key)
    sender.connect(endpoint)             # optional eager handshake; TransferError if refused
    sender.send(rid, endpoint_or_endpoints, src_block_ids, src_slot,
                dst_block_ids, dst_slot, skip_blocks=0)   # starts, never waits for data
    sender.send(..., layerwise=True)     # nothing leaves until the layers are reported:
    sender.layers_done(rid, [layer])     # these layers are final: their bytes leave now
    sender.poll() -> [TransferEvent(rid, ok, error)]      # then free the prefill copy
    sender.abort(rid); sender.close()

Block tables are the full tables on both sides (same length); the first `skip_blocks`
are already held by decode and are not sent. `endpoint` may list every stage of a
pipeline-parallel decode worker; each stage receives the layers it owns. Slots may be
None on state-free stages. Every method is thread-safe. The layer never frees blocks:
events tell the worker, whose cache manager frees or adopts them.

Files: layout.py (addresses/strides), planner.py (descriptors), fingerprint.py,
wire.py (msgpack messages), side_channel.py (ZeroMQ), receiver.py / sender.py
(leases, events), nixl_backend.py / ucx_backend.py (bytes).
"""

from __future__ import annotations

import importlib

from baton.config.transfer import TransferConfig
from baton.model.pools import Pools
from transfer.base import TransferEvent
from transfer.fingerprint import compute_fingerprint

_BACKENDS = {"nixl": ("transfer.nixl_backend", "NixlReceiver", "NixlSender"),
             "ucx": ("transfer.ucx_backend", "UcxReceiver", "UcxSender")}

__all__ = ["SIDE_CHANNEL", "TransferConfig", "TransferEvent", "compute_fingerprint",
           "make_receiver", "make_sender", "tp_identity"]

SIDE_CHANNEL = "transfer-side-channel"
"""The purpose name of the side-channel key derived from the cluster secret."""


def _backend(cfg: TransferConfig, index: int):
    module, *names = _BACKENDS[cfg.backend]  # imported lazily: never both UCX copies
    return getattr(importlib.import_module(module), names[index])


def make_receiver(cfg: TransferConfig, pools: Pools, fingerprint: dict,
                  bind_host: str = "127.0.0.1", key: bytes | None = None):
    """Decode-side endpoint of one stage (see module doc); `key` seals the side channel."""
    from transfer.receiver import Receiver

    return Receiver(cfg, pools, fingerprint, bind_host, _backend(cfg, 0), key)


def make_sender(cfg: TransferConfig, pools: Pools, fingerprint: dict, key: bytes | None = None,
                tp=None):
    """Prefill-side endpoint of one stage (see module doc); `key` seals the side channel;
    `tp` (`tp_identity`): this rank's place, to write decode ranks of any TP size."""
    from transfer.sender import Sender

    return Sender(cfg, pools, fingerprint, _backend(cfg, 1), key, tp)


def tp_identity(model, spec, rank: int = 0, size: int = 1, weight_format: str | None = None,
                cache_format: str | None = None):
    """(fingerprint, TPSide) of rank `rank` of a TP-`size` worker of the whole model `model`
    whose pools follow `spec` (dtype, tokens per block), serving weights in `weight_format`."""
    from transfer.tp_route import TPSide

    fingerprint = compute_fingerprint(model, spec, tp_size=size, tp_rank=rank,
                                      weight_format=weight_format, cache_format=cache_format)
    side = TPSide(rank, size, model, str(spec.dtype).removeprefix("torch."),
                  spec.tokens_per_block, str(spec.kv_store_dtype).removeprefix("torch."))
    return fingerprint, side
