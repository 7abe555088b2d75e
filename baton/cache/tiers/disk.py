"""The disk tier: one file per entry in `cache.tier.path`, at most `cache.tier.bytes` in all.

    <path>/<fmt>-<snapshot_hash>.snap            committed entries (entry.py's layout)
    <path>/.tmp-<host>-<pid>-<random>            an entry being written

Write, then commit: the entry goes to a private temporary file, is fsynced, then hard-linked
to its final name (`link` never replaces an existing name, so two workers sharing the folder
never overwrite each other: the first commit of a key wins, the other drops its copy) and the
temporary name removed. A worker killed mid-write leaves only a `.tmp-` file, which no reader
looks at and the next worker on the host removes once its writer is dead. A restarted worker
(any id) scans the folder and keeps each entry whose header checks; the payload's checksum
is checked on every read, and an entry that fails a check is removed and counted a miss.
Workers sharing the folder see each other's new entries: a changed folder is rescanned.

Thread-safe: the index is guarded by one lock, the payload I/O runs outside it (the worker's
tiers read and write on their I/O thread while the engine thread looks entries up).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass

import torch

from baton.cache.tiers.entry import PREFIX, BadEntry, Header, Layout, decode_header, decode_prefix
from baton.cache.tiers.fileio import FileIO
from baton.cache.tiers.stats import TierCounters
from baton.cache.value import Candidate, pick_victim
from baton.config.cache_tiers import EvictionConfig
from baton.errors import ConfigError

log = logging.getLogger("baton.cache.tiers")

SUFFIX = ".snap"
TMP = ".tmp-"


@dataclass
class _Meta:
    n: int
    size: int
    saved: float
    last: int
    bh: int
    sh: int


class DiskTier:
    name = "disk"

    def __init__(self, path: str, capacity: int, layout: Layout, io: FileIO,
                 eviction: EvictionConfig, clock):
        self.path, self.capacity, self.layout, self.io = path, capacity, layout, io
        self.eviction, self.clock = eviction, clock
        self.stats = TierCounters()
        self.listener = None
        """`fn(added, block_hash, snapshot_hash, num_tokens)` on every entry added or removed
        (the worker's router events, tier 1)."""
        self._lock = threading.RLock()
        self._index: dict[str, _Meta] = {}
        self._lengths: dict[int, int] = {}
        self._used = 0
        self._dir_mtime = -1
        self._prefix = f"{layout.fmt}-"
        self._check_path()
        self._clean_tmp()
        self._refresh()
        log.info("disk tier %s: %d entries (%d bytes) of %d found, I/O %s", path,
                 len(self._index), self.used, capacity, io.name)

    # ---- start-up checks ---------------------------------------------------------------
    def _check_path(self) -> None:
        smallest = self.layout.entry_bytes(1)
        if self.capacity < smallest:
            raise ConfigError(
                f"cache.tier.bytes={self.capacity} is too small for one entry ({smallest} bytes "
                f"for one block and its state); raise it or remove cache.tier.path")
        try:
            os.makedirs(self.path, exist_ok=True)
            probe = self._tmp_name()
            with open(probe, "wb") as f:
                f.write(b"probe")
            final = probe + ".link"
            os.link(probe, final)
            os.unlink(final)
            os.unlink(probe)
        except OSError as e:
            raise ConfigError(
                f"cache.tier.path={self.path!r} cannot hold the disk tier ({e.strerror or e}: "
                "it must be a writable folder on a filesystem with hard links); fix it or "
                "remove cache.tier.path") from None

    def _tmp_name(self) -> str:
        host = socket.gethostname().replace("-", "_")
        return os.path.join(self.path, f"{TMP}{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}")

    def _clean_tmp(self) -> None:
        """Remove temporary files whose writer (on this host) is dead: killed mid-write."""
        host = socket.gethostname().replace("-", "_")
        for name in os.listdir(self.path):
            parts = name[len(TMP):].split("-")
            if not name.startswith(TMP) or len(parts) < 3 or parts[0] != host:
                continue
            if not parts[1].isdigit() or _alive(int(parts[1])):
                continue
            _unlink(os.path.join(self.path, name))
            self.stats.removed_tmp += 1

    # ---- index -------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Bytes of the entries indexed now."""
        return self._used

    def _refresh(self) -> None:
        """Re-read the folder when it changed (another worker committed or removed)."""
        with self._lock:
            self._refresh_locked()

    def _refresh_locked(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if mtime == self._dir_mtime:
            return
        self._dir_mtime = mtime
        names = {n[: -len(SUFFIX)] for n in os.listdir(self.path)
                 if n.startswith(self._prefix) and n.endswith(SUFFIX)}
        for key in [k for k in self._index if k not in names]:
            self._forget(key)
        for key in names - set(self._index):
            h = self._read_header(key)
            if h is not None:
                self._add(key, h, self._file_size(key))

    def _read_header(self, key: str) -> Header | None:
        try:
            with open(self._file(key), "rb") as f:
                hlen, hcrc = decode_prefix(f.read(PREFIX.size))
                h = decode_header(f.read(hlen), hcrc)
                self.layout.check_header(h)
                if os.fstat(f.fileno()).st_size != PREFIX.size + hlen + h.payload_bytes:
                    raise BadEntry("file size does not match its header (truncated)")
                return h
        except FileNotFoundError:
            return None
        except (BadEntry, OSError) as e:
            self._reject(key, str(e))
            return None

    def _add(self, key: str, h: Header, size: int) -> None:
        sh = int(key[len(self._prefix):], 16)
        meta = self._index[key] = _Meta(h.n, size, h.flops, self.clock(), h.bh, sh)
        self._lengths[h.n] = self._lengths.get(h.n, 0) + 1
        self._used += size
        self._notify(True, meta)

    def _forget(self, key: str) -> None:
        m = self._index.pop(key)
        self._used -= m.size
        self._lengths[m.n] -= 1
        if not self._lengths[m.n]:
            del self._lengths[m.n]
        self._notify(False, m)

    def _notify(self, added: bool, m: _Meta) -> None:
        if self.listener is not None:
            self.listener(added, m.bh, m.sh, m.n)

    def entries(self) -> list[tuple[int, int, int]]:
        """(block_hash, snapshot_hash, num_tokens) of every entry held now."""
        with self._lock:
            return [(m.bh, m.sh, m.n) for m in self._index.values()]

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key + SUFFIX)

    def _file_size(self, key: str) -> int:
        try:
            return os.stat(self._file(key)).st_size
        except OSError:
            return 0

    def _reject(self, key: str, why: str) -> None:
        log.warning("disk tier entry %s is not usable (%s): removed, counted a miss", key, why)
        with self._lock:
            self.stats.corrupt += 1
            _unlink(self._file(key))
            if key in self._index:
                self._forget(key)

    # ---- the tier's calls --------------------------------------------------------------
    def key(self, snapshot_hash: int) -> str:
        return f"{self._prefix}{snapshot_hash:016x}"

    def lengths(self) -> list[int]:
        with self._lock:
            self._refresh_locked()
            return sorted(self._lengths)

    def has(self, key: str) -> bool:
        return key in self._index

    def get(self, key: str, tokens: list[int]) -> tuple[Header, torch.Tensor] | None:
        """The entry, checked; None (a miss) if absent or failing any check."""
        with self._lock:
            if key not in self._index:
                return None
            try:
                fd = os.open(self._file(key), os.O_RDONLY)
            except FileNotFoundError:
                self._forget(key)
                return None
        try:
            hlen, hcrc = decode_prefix(os.pread(fd, PREFIX.size, 0))
            h = decode_header(os.pread(fd, hlen, PREFIX.size), hcrc)
            self.layout.check_header(h)
            payload = self.io.read(fd, PREFIX.size + hlen, h.payload_bytes)
            self.layout.check_payload(h, payload, tokens)
        except (BadEntry, OSError) as e:
            self._reject(key, str(e))
            return None
        finally:
            os.close(fd)
        with self._lock:
            if key in self._index:
                self._index[key].last = self.clock()
        return h, payload

    def put(self, key: str, h: Header, payload: torch.Tensor) -> bool:
        """Write and commit an entry, evicting others for room; False if it cannot fit or
        the write failed (logged: a tier is an optimisation, never worth failing for)."""
        head = h.encode()
        size = len(head) + payload.numel()
        with self._lock:
            if key in self._index:
                self._index[key].last = self.clock()
                return True
            if size > self.capacity:
                self.stats.rejected += 1
                return False
            self._make_room(size)
        tmp = self._tmp_name()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.pwrite(fd, head, 0)
                self.io.write(fd, len(head), payload)
                os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:  # commit and index together (a rescan must not see it first)
                try:
                    os.link(tmp, self._file(key))
                except FileExistsError:
                    pass  # another worker committed this key first: its entry stands
                if key not in self._index:
                    self._add(key, h, size)
                    self.stats.admitted += 1
                    self.stats.bytes_written += size
        except OSError as e:
            log.warning("disk tier write of %s failed (%s); entry not kept", key, e)
            self.stats.errors += 1
            return False
        finally:
            _unlink(tmp)
        return True

    def _make_room(self, size: int) -> None:
        while self._index and self.used + size > self.capacity:
            cands = [Candidate(k, m.saved, m.size, m.last) for k, m in self._index.items()]
            key = pick_victim(cands, self.clock(), self.eviction)
            _unlink(self._file(key))
            self._forget(key)
            self.stats.evicted += 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
