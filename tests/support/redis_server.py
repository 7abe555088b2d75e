"""A private redis-server for tests (the shared cache tier): loopback, a free port, requirepass
derived from a cluster secret, bounded by maxmemory, nothing saved to disk.

Debian's `redis-server` is installed when missing (apt-get, root), as tests/support/slurm.py
installs Slurm, so CI's fresh clone (`.ci/run`, root) needs nothing done by hand. Where it
cannot be installed (not root, no apt-get), `RedisUnavailable` says why in one line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from baton.cache.tiers.shared import store_password
from baton.cluster.local import free_port
from tests.support.apt import apt_install

PACKAGE = "redis-server"


class RedisUnavailable(Exception):
    pass


def ensure_redis_server() -> str:
    """Path of redis-server, installing Debian's package when missing (root only; one
    installer at a time across pytest workers)."""
    found = shutil.which("redis-server")
    if found:
        return found
    import fcntl

    with open(os.path.join(tempfile.gettempdir(), "baton-redis-install.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return shutil.which("redis-server") or _install()


def _install() -> str:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RedisUnavailable("redis-server is not installed and installing it needs root "
                               "and apt-get (apt-get install redis-server)")
    r = apt_install([PACKAGE])
    found = shutil.which("redis-server")
    if not found:
        raise RedisUnavailable(f"apt-get install {PACKAGE} failed: {r.stderr.strip()[-300:]}")
    return found


class RedisServer:
    """`with RedisServer(token) as srv:` srv.url is redis://127.0.0.1:PORT/0."""

    def __init__(self, token: str, maxmemory: str = "64mb"):
        self.token, self.maxmemory = token, maxmemory
        self.password = store_password(token)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        exe = ensure_redis_server()
        self.port = self.port or free_port()
        self._dir = tempfile.mkdtemp(prefix="baton-redis-")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass",
                self.password, "--maxmemory", self.maxmemory, "--maxmemory-policy",
                "allkeys-lru", "--save", "", "--appendonly", "no", "--dir", self._dir,
                "--daemonize", "no", "--protected-mode", "yes"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import redis

        r = redis.Redis(port=self.port, password=self.password, socket_timeout=0.5)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisUnavailable(f"redis-server exited: {self.proc.stderr.read()[-300:]}")
            try:
                if r.ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RedisUnavailable(f"redis-server on port {self.port} did not answer in 20 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def client(self):
        import redis

        return redis.Redis(port=self.port, password=self.password)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)
