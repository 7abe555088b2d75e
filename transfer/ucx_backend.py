"""UCX transport on `ucxx` (two-sided tag messages), same interface as the NIXL backend.

ucxx has no one-sided RMA in Python, so the decode side receives into its own pools:

    prefill (post)                                  decode (per connected endpoint)
      am_send header {seq, notif, ranges} ───────►  authorize rid / blocks / slot and check
                                                    every dst range lies in those units
                                          ◄───────  am_send {ok, error}   (no bytes if refused)
      tag send src range i (tag seq<<24|i) ──────►  tag recv into dst range i of the pool
                                          ◄───────  am_send {ok}; notif queued for drain()

Ranges are the planner's coalesced pairs; the receiver never trusts an address it cannot
map inside the blocks and slot reserved for that request. One asyncio loop thread per
process runs ucxx; facade calls hop onto it with run_coroutine_threadsafe. One transfer
at a time per endpoint (an asyncio lock), so control messages pair up in order.

UCX settings on CPU-only hosts: UCX_TLS unset lets UCX pick cma/sysv + tcp;
`transfer.ucx_tls: tcp` where shared memory / ptrace is not allowed. ucxx bundles its
own UCX: never import it in a process that loaded NIXL (two UCX copies hang or crash).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import os
import sys
import threading

import msgpack
import numpy as np
import torch

from baton.config.ports import PortRange
from baton.config.transfer import TransferConfig
from baton.errors import TransferError
from baton.model.pools import Pools
from transfer import wire
from transfer.base import RecvTransport, SendTransport
from transfer.layout import StageLayout
from transfer.planner import Plan, coalesce, plan


def _ucxx(cfg: TransferConfig):
    if any(m.startswith("nixl") for m in sys.modules):
        raise TransferError("NIXL is loaded in this process; NIXL and ucxx must not share one "
                            "(two UCX copies): use one backend per process")
    os.environ.update(cfg.ucx_env)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # requests complete through ucxx's notifier thread (Python futures), not by yield-polling
    # from the asyncio loop: the latter kept an idle decode worker at 100% of a core
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    import ucxx

    return ucxx


class _Loop:
    """A daemon thread running the asyncio loop that owns every ucxx object.

    One per process, for its whole life: ucxx's notifier completes requests on the loop it
    first saw, so a second loop would get futures attached to the first one."""

    _instance: _Loop | None = None
    _lock = threading.Lock()

    @classmethod
    def shared(cls) -> _Loop:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="baton-ucx", daemon=True).start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float):
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()  # never leave a half-made endpoint running unreferenced
            raise


class _Memory:
    """Pool memory as numpy byte views, looked up by address."""

    def __init__(self, pools: Pools):
        regions = [(t.data_ptr(), t.view(-1).view(torch.uint8).numpy())
                   for t in pools.tensors if t.numel()]
        if any(t.device.type != "cpu" for t in pools.tensors):
            raise TransferError("transfer.backend 'ucx' supports CPU pools only; use 'nixl'")
        self._regions = sorted(regions, key=lambda r: r[0])
        self._starts = [r[0] for r in self._regions]

    def view(self, addr: int, n: int) -> np.ndarray:
        i = bisect.bisect_right(self._starts, addr) - 1
        base, arr = self._regions[max(i, 0)]
        if i < 0 or addr - base + n > arr.size:
            raise TransferError(f"range {addr:#x}+{n} is outside the registered pools")
        return arr[addr - base: addr - base + n]


def _tag(seq: int, i: int) -> int:
    return ((seq % (1 << 30)) << 24) | i


class UcxReceiver(RecvTransport):
    backend = "ucx"

    def __init__(self, cfg: TransferConfig, pools: Pools, bind_host: str, authorize):
        self._ucxx = _ucxx(cfg)
        self._mem, self._layout = _Memory(pools), StageLayout.from_pools(pools)
        self._authorize, self._max = authorize, cfg.max_message_bytes
        self._connect_s = cfg.handshake_timeout_s
        self._landed: collections.deque[bytes] = collections.deque()
        self._loop = _Loop.shared()
        self._listener = self._loop.run(self._listen(cfg.ucx_ports), 30)
        self._meta = {"host": bind_host, "port": self._listener.port}

    async def _listen(self, ports: PortRange):
        # ucxx listens on every interface: only the port can be chosen (transfer.ucx_port)
        return ports.bind(self._listen_on, "transfer.ucx_port")

    def _listen_on(self, port: int):
        try:
            return self._ucxx.create_listener(self._serve, port=port or None,
                                              connect_timeout=self._connect_s)
        except self._ucxx.UCXXBusyError as e:
            raise OSError(f"UCX port {port} is taken: {e}") from None

    async def _serve(self, ep) -> None:
        try:
            while True:
                hdr = bytes(await ep.am_recv())
                err, notif, dst = self._admit(hdr)
                await ep.am_send(np.frombuffer(msgpack.packb({"ok": err is None, "error": err}),
                                               np.uint8))
                if err is None:
                    seq = msgpack.unpackb(hdr)["seq"]
                    await asyncio.gather(*(ep.recv(self._mem.view(int(a), int(n)), tag=_tag(seq, i))
                                           for i, (a, n) in enumerate(dst)))
                    self._landed.append(notif)
                    await ep.am_send(np.frombuffer(msgpack.packb({"ok": True}), np.uint8))
        except Exception:  # peer gone or garbage: drop this endpoint, keep serving others
            ep.abort()

    def _admit(self, hdr: bytes):
        try:
            msg = wire.decode(hdr, self._max, ops=("ucx_data",))
            notif = wire.decode(msg["notif"], self._max, ops=("landed",))
            blocks = wire.landed_blocks(notif)
            dst = np.frombuffer(msg["ranges"], dtype="<u8").reshape(-1, 2)
        except (TransferError, ValueError) as e:
            return f"malformed transfer header: {e}", None, None
        err = self._authorize(notif["rid"], notif["slot"], blocks)
        if err is None:
            err = _outside(self._layout, notif, blocks, dst)
        return err, msg["notif"], dst

    def metadata(self) -> dict:
        return self._meta

    def drain(self) -> list[bytes]:
        out = []
        while self._landed:
            out.append(self._landed.popleft())
        return out

    def close(self) -> None:
        self._loop.submit(self._close_listener()).result(5)

    async def _close_listener(self):
        self._listener.close()


def _outside(layout: StageLayout, notif: dict, blocks: np.ndarray, dst: np.ndarray) -> str | None:
    """Why some dst range leaves the units reserved for this request, or None."""
    slot = notif["slot"] if layout.state else 0
    if layout.state is not None and slot is None:
        return "transfer names no slot for a stage with recurrent state"
    own = plan(layout, layout, blocks.tolist(), slot, blocks.tolist(), slot).select(notif["layers"])
    if dst.size == 0:
        return None
    order = np.argsort(own.dst_addr)
    allowed, _ = coalesce(own.dst_addr[order], own.dst_addr[order], own.length[order])
    if allowed.size == 0:
        return "transfer writes into layers this stage does not hold"
    starts, ends = allowed[:, 0], allowed[:, 0] + allowed[:, 1]
    i = np.searchsorted(starts, dst[:, 0], side="right") - 1
    ok = (i >= 0) & (dst[:, 0] + dst[:, 1] <= ends[np.maximum(i, 0)])
    return None if ok.all() else f"range at {int(dst[~ok][0, 0]):#x} is outside the reservation"


class _Peer:
    def __init__(self, ep):
        self.ep, self.lock, self.seq, self.broken = ep, asyncio.Lock(), 0, False


class UcxSender(SendTransport):
    backend = "ucx"

    def __init__(self, cfg: TransferConfig, pools: Pools, layout: StageLayout):
        self._ucxx, self._cfg = _ucxx(cfg), cfg
        self._mem = _Memory(pools)
        self._loop = _Loop.shared()

    def add_peer(self, meta: dict, layout: StageLayout) -> _Peer:
        host, port = meta.get("host"), meta.get("port")
        if not isinstance(host, str) or not isinstance(port, int):
            raise TransferError("decode peer sent no UCX address; is it running backend 'nixl'?")
        try:
            t = self._cfg.handshake_timeout_s
            ep = self._loop.run(self._ucxx.create_endpoint(host, port, connect_timeout=t), t + 1)
        except Exception as e:
            raise TransferError(f"UCX connect to {host}:{port} failed: {e}") from None
        return _Peer(ep)

    def remove_peer(self, peer: _Peer) -> None:
        self._loop.loop.call_soon_threadsafe(peer.ep.abort)

    def post(self, peer: _Peer, plan: Plan, notif: bytes):
        src, dst = plan.coalesced()
        return (peer, self._loop.submit(self._transfer(peer, notif, src, dst)))

    async def _transfer(self, peer: _Peer, notif: bytes, src: np.ndarray, dst: np.ndarray):
        async with peer.lock:
            if peer.broken:
                raise TransferError("UCX endpoint is broken by an earlier cancelled transfer")
            peer.seq += 1
            seq, ep = peer.seq, peer.ep
            hdr = wire.encode("ucx_data", seq=seq, notif=notif,
                              ranges=np.ascontiguousarray(dst, dtype="<u8").tobytes())
            await ep.am_send(np.frombuffer(hdr, np.uint8))
            go = msgpack.unpackb(bytes(await ep.am_recv()))
            if not go.get("ok"):
                raise TransferError(f"decode refused the transfer: {go.get('error')}")
            await asyncio.gather(*(ep.send(self._mem.view(int(a), int(n)), tag=_tag(seq, i))
                                   for i, (a, n) in enumerate(src)))
            await ep.am_recv()

    def check(self, post) -> tuple[str, str | None]:
        _, fut = post
        if not fut.done():
            return "PROC", None
        e = fut.exception()
        return ("DONE", None) if e is None else ("ERR", f"UCX transfer failed: {e}")

    def release(self, post) -> None:
        peer, fut = post
        if not fut.done():  # cancelled mid-stream: the endpoint's message order is lost
            peer.broken = True
            fut.cancel()

    def close(self) -> None:
        """Peers are closed by remove_peer; the shared loop lives on with the process."""
