"""Moving an entry's payload between memory and a file: NIXL's POSIX backend, or plain
pread/pwrite behind the same two calls (`io: file`, or where NIXL has no POSIX plugin).

The NIXL path registers the payload buffer (DRAM) and the file range (FILE: offset,
length, fd) for each transfer, posts one WRITE or READ to itself and polls it to DONE.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import torch

from baton.errors import ConfigError

log = logging.getLogger("baton.cache.tiers")

XFER_TIMEOUT_S = 60.0


class FileIO:
    name = "file"

    def write(self, fd: int, offset: int, buf: torch.Tensor) -> None:
        view = memoryview(buf.numpy())
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n

    def read(self, fd: int, offset: int, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view, got = memoryview(buf.numpy()), 0
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise OSError(f"file ends {nbytes - got} bytes early")
            got += n
        return buf

    def close(self) -> None:
        pass


class NixlPosixIO(FileIO):
    """The same calls through a NIXL agent with only the POSIX backend (no UCX thread)."""

    name = "nixl-posix"

    def __init__(self):
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.agent_name = f"baton-tier-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        nixl_log = logging.getLogger("nixl")
        level = nixl_log.level
        nixl_log.setLevel(max(level, logging.WARNING))  # its INFO lines go to stdout
        try:
            self.agent = nixl_agent(self.agent_name,
                                    nixl_agent_config(enable_prog_thread=False, backends=[]))
            if "POSIX" not in self.agent.get_plugin_list():
                raise ConfigError("NIXL has no POSIX plugin here; set cache.tier.io: file")
            self.agent.create_backend("POSIX", {})
        finally:
            nixl_log.setLevel(level)
        self._lock = threading.Lock()  # one agent, one transfer at a time

    def write(self, fd: int, offset: int, buf: torch.Tensor) -> None:
        self._xfer("WRITE", fd, offset, buf)

    def read(self, fd: int, offset: int, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self._xfer("READ", fd, offset, buf)
        return buf

    def _xfer(self, op: str, fd: int, offset: int, buf: torch.Tensor) -> None:
        a, n = self.agent, buf.numel()
        with self._lock:
            mem = a.register_memory(buf, "DRAM")
            try:
                freg = a.register_memory([(offset, n, fd, "")], "FILE")
                try:
                    h = a.initialize_xfer(op, a.get_xfer_descs(buf, "DRAM"),
                                          a.get_xfer_descs([(offset, n, fd)], "FILE"),
                                          self.agent_name)
                    try:
                        self._wait(a, h, op, n)
                    finally:
                        a.release_xfer_handle(h)
                finally:
                    a.deregister_memory(freg)
            finally:
                a.deregister_memory(mem)

    @staticmethod
    def _wait(a, h, op: str, n: int) -> None:
        state, deadline = a.transfer(h), time.monotonic() + XFER_TIMEOUT_S
        pause = 20e-6  # polled with growing sleeps: a long read does not hold a core
        while state == "PROC":
            if time.monotonic() > deadline:
                raise OSError(f"NIXL POSIX {op} of {n} bytes did not finish in {XFER_TIMEOUT_S}s")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
            state = a.check_xfer_state(h)
        if state != "DONE":
            raise OSError(f"NIXL POSIX {op} of {n} bytes ended in state {state}")

    def close(self) -> None:
        pass


def open_io(kind: str) -> FileIO:
    """`nixl`: NIXL's POSIX backend; where it cannot be created, say why and use file I/O."""
    if kind == "file":
        return FileIO()
    try:
        return NixlPosixIO()
    except Exception as e:  # noqa: BLE001 - any failure to start NIXL means: plain files
        log.warning("cache.tier.io: nixl unavailable (%s); the disk tier uses plain file I/O",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return FileIO()
