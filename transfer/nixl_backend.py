"""NIXL transport: one agent per stage process, one-sided WRITE into the decode pools.

    start     agent created, whole pools registered once, own unit table prepped once
    connect   decode metadata added (add_remote_agent), its unit table prepped once
    post      make_prepped_xfer(WRITE, local units, remote units, notif) + transfer;
              NIXL merges consecutive indices over contiguous memory, so a run of
              blocks contiguous on both sides goes out as one UCX operation
    land      the decode agent sees the notification only after all bytes are in place
    leave     release xfer handles, release the peer's dlist, remove_remote_agent

UCX settings on CPU-only hosts (checked with nixl-cu12 1.5.1, bundled UCX 1.23):
  * UCX_TLS unset (default here): bytes move by `cma` (zero-copy process_vm_writev between
    processes on one host), control over `tcp`. Where ptrace is not allowed (some
    containers) set `transfer.ucx_tls: tcp`.
  * Lists without `tcp` (e.g. `sm,self`) fail in create_backend: the default `peer` error
    mode needs a transport with active messages.
  * Never import this module and `ucxx` in one process: two UCX copies hang or crash.
Agents are only touched under the owning Receiver/Sender lock (NIXL locking is off).
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

from baton.config.transfer import TransferConfig
from baton.errors import TransferError
from baton.model.pools import Pools
from transfer.base import RecvTransport, SendTransport
from transfer.layout import StageLayout
from transfer.planner import Plan

_MEM = {"cpu": "DRAM", "cuda": "VRAM"}


_live_agents = 0
"""NIXL agents alive in this process: one is supported (two in one process abort in UCX)."""


def _agent(cfg: TransferConfig, role: str):
    global _live_agents
    if _live_agents:
        raise TransferError("this process already runs a NIXL transfer endpoint; use one "
                            "receiver or sender per stage process (close the other first)")
    if "ucxx" in sys.modules:
        raise TransferError("ucxx is loaded in this process; NIXL and ucxx must not share one "
                            "(two UCX copies): use one backend per process")
    os.environ.update(cfg.ucx_env)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    for name in ("nixl", "nixl_cu12", "nixl_cu12._api"):
        logging.getLogger(name).setLevel(logging.WARNING)

    name = f"baton-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # No progress thread: NIXL's spins a core even when idle. The owner's poll loop progresses
    # the agent instead (check_xfer_state / get_new_notifs), only while transfers are due.
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    _live_agents += 1
    return agent


def _retire(agent) -> None:
    global _live_agents
    _live_agents -= 1


def _register(agent, pools: Pools):
    tensors = [t for t in pools.tensors if t.numel()]
    return agent.register_memory(tensors) if tensors else None


class NixlReceiver(RecvTransport):
    backend = "nixl"

    def __init__(self, cfg: TransferConfig, pools: Pools, bind_host: str, authorize):
        self._agent = _agent(cfg, "decode")
        self._reg = _register(self._agent, pools)
        self._meta = {"agent": self._agent.name, "metadata": self._agent.get_agent_metadata()}

    def metadata(self) -> dict:
        return self._meta

    def drain(self) -> list[bytes]:
        if self._agent is None:
            return []
        return [m for msgs in self._agent.get_new_notifs().values() for m in msgs]

    def close(self) -> None:
        if self._agent is not None:
            _quietly(self._agent.deregister_memory, self._reg)
            _retire(self._agent)
            self._agent = None


class _Peer:
    def __init__(self, name: str, dlist, units, mem: str):
        self.name, self.dlist, self.units, self.mem = name, dlist, units, mem


class NixlSender(SendTransport):
    backend = "nixl"

    def __init__(self, cfg: TransferConfig, pools: Pools, layout: StageLayout):
        self._agent = _agent(cfg, "prefill")
        self._reg = _register(self._agent, pools)
        self._mem = _MEM[layout.device]
        units = layout.unit_table()
        self._units = units
        self._local = self._agent.prep_xfer_dlist("", units, self._mem) if len(units) else None

    def add_peer(self, meta: dict, layout: StageLayout) -> _Peer:
        if not isinstance(meta.get("metadata"), bytes):
            raise TransferError("decode peer sent no NIXL metadata; is it running backend 'ucx'?")
        name = self._agent.add_remote_agent(meta["metadata"])
        name = name.decode() if isinstance(name, bytes) else name
        units = layout.unit_table()
        try:
            dlist = self._agent.prep_xfer_dlist(name, units, _MEM[layout.device]) \
                if len(units) else None
        except Exception:
            self._agent.remove_remote_agent(name)
            raise
        return _Peer(name, dlist, units, _MEM[layout.device])

    def remove_peer(self, peer: _Peer) -> None:
        _quietly(self._agent.release_dlist_handle, peer.dlist)
        _quietly(self._agent.remove_remote_agent, peer.name)

    def post(self, peer: _Peer, plan: Plan, notif: bytes):
        try:
            if plan.length.size == 0:
                self._agent.send_notif(peer.name, notif)  # layers covered, nothing to move
                return None
            if _whole_units(plan, self._units, peer.units):
                h = self._agent.make_prepped_xfer("WRITE", self._local,
                                                  plan.src_units.astype("i4"), peer.dlist,
                                                  plan.dst_units.astype("i4"), notif)
            else:  # tensor-parallel pieces: ranges inside units, posted by address
                h = self._by_address("WRITE", peer, plan, notif)
            state = self._agent.transfer(h)
        except Exception as e:
            return _Failed(f"NIXL post to {peer.name} failed: {type(e).__name__}: {e}")
        return _Failed(f"NIXL post to {peer.name} returned ERR") if state == "ERR" else h

    def _by_address(self, op: str, peer: _Peer, plan: Plan, notif: bytes = b""):
        """One transfer over the plan's coalesced ranges (inside the registered pools)."""
        import numpy as np

        src, dst = plan.coalesced()

        def rows(ranges, units):  # (addr, len, device id of the pool)
            dev = np.full((len(ranges), 1), units[0, 2] if len(units) else 0, dtype=np.uint64)
            return np.hstack([ranges, dev])

        local = self._agent.get_xfer_descs(rows(src, self._units), self._mem)
        remote = self._agent.get_xfer_descs(rows(dst, peer.units), peer.mem)
        return self._agent.initialize_xfer(op, local, remote, peer.name, notif)

    def read(self, peer: _Peer, plan: Plan):
        try:
            if plan.length.size == 0:
                return None
            h = self._agent.make_prepped_xfer("READ", self._local, plan.src_units.astype("i4"),
                                              peer.dlist, plan.dst_units.astype("i4"))
            state = self._agent.transfer(h)
        except Exception as e:
            return _Failed(f"NIXL read from {peer.name} failed: {type(e).__name__}: {e}")
        return _Failed(f"NIXL read from {peer.name} returned ERR") if state == "ERR" else h

    def check(self, post) -> tuple[str, str | None]:
        if post is None:
            return "DONE", None
        if isinstance(post, _Failed):
            return "ERR", post.error
        try:
            state = self._agent.check_xfer_state(post)
        except Exception as e:
            return "ERR", f"NIXL transfer failed: {type(e).__name__}: {e}"
        return state, ("NIXL transfer state ERR" if state == "ERR" else None)

    def release(self, post) -> None:
        if post is not None and not isinstance(post, _Failed):
            _quietly(self._agent.release_xfer_handle, post)

    def close(self) -> None:
        _quietly(self._agent.release_dlist_handle, self._local)
        self._local = None
        if self._agent is not None:
            _quietly(self._agent.deregister_memory, self._reg)
            _retire(self._agent)
            self._agent = None


def _whole_units(plan: Plan, local, remote) -> bool:
    """Whether every descriptor is exactly one unit on both sides (the prepped path)."""
    import numpy as np

    s, d = plan.src_units.astype(np.int64), plan.dst_units.astype(np.int64)
    return bool((local[s, 0] == plan.src_addr).all() and (local[s, 1] == plan.length).all()
                and (remote[d, 0] == plan.dst_addr).all()
                and (remote[d, 1] == plan.length).all())


class _Failed:
    def __init__(self, error: str):
        self.error = error


def _quietly(fn, handle) -> None:
    """Teardown must go on past a peer that already vanished."""
    if handle is None:
        return
    try:
        fn(handle)
    except Exception as e:
        logging.getLogger(__name__).debug("NIXL teardown %s: %s", fn.__name__, e)
