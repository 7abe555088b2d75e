"""Hosts as Linux network namespaces on one bridge, for tests whose traffic crosses real links.

    root namespace (the test process)        bridge bt<tag>br, address 198.18.N.254/24
      bt<tag>h0 ════ eth0  netns baton-<pid>-<tag>-router     198.18.N.1
      bt<tag>h1 ════ eth0  netns baton-<pid>-<tag>-prefill0   198.18.N.2
      ...            (one veth pair per host; the root end is the bridge port)

198.18.0.0/15 is reserved for benchmarking (RFC 2544) and never routed, and nothing here adds
a default route: packets stay among the namespaces this run made and the bridge. Each run picks
a fresh `<tag>` and a /24 no route in the root namespace uses, so concurrent runs never clash.
A host's link is its veth pair: `tx_bytes(host)` counts what the host sent onto it (read at the
bridge end), `link_down(host)` pulls the cable (peers see silence, not resets).

Cleanup, always: `close()` kills every process it started by PID, deletes the veths, the
namespaces and the bridge. Children also die with the test process
(PR_SET_PDEATHSIG), and `Network()` first removes what a run that was SIGKILLed left behind
(names carry the owner's PID).
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NET = ipaddress.ip_network("198.18.0.0/15")
PREFIX = "baton-"
STALE = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]{{6}})-")
"""Namespace names: baton-<owner pid>-<tag>-<host>."""
ALIAS = re.compile(r"^baton-test-(\d+)$")
"""Alias of the bridge and of each veth's bridge end: baton-test-<owner pid>."""
PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 3.0


class Unavailable(Exception):
    """Namespaces cannot be made here; the message is the one-line reason."""


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str
    link: str
    """The bridge end of this host's veth pair (in the root namespace)."""


def unavailable() -> str | None:
    """Why this machine cannot make namespaces (None: it may; `Network()` still can fail)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (run the multi-host tests as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing; install it to run the multi-host tests"
    return None


def _ip(*args: str) -> str:
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"`ip {' '.join(args)}` hung for 20 s") from e
    if done.returncode:
        err = "; ".join(line.strip() for line in done.stderr.splitlines() if line.strip())
        if "Operation not permitted" in err or "Permission denied" in err:
            raise Unavailable(f"`ip {' '.join(args)}`: {err} (no CAP_NET_ADMIN here)")
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {err}")
    return done.stdout


def _quiet(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, timeout=20)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def sweep_stale() -> list[str]:
    """Remove what runs whose process is gone left behind: namespaces (named with the owner's
    PID) and their processes, bridges and veths (the owner's PID is in their alias)."""
    removed = []
    for ns in _ip("netns", "list").split():
        m = STALE.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_netns_pids(ns)
            _quiet("netns", "del", ns)
            removed.append(ns)
    for link in json.loads(_ip("-j", "link", "show") or "[]"):
        m = ALIAS.match(link.get("ifalias", ""))
        if m and not _alive(int(m.group(1))):
            _quiet("link", "del", link["ifname"])
            removed.append(link["ifname"])
    return removed


def _kill_netns_pids(ns: str) -> None:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _free_subnet() -> ipaddress.IPv4Network:
    used = [ipaddress.ip_network(r["dst"], strict=False)
            for r in json.loads(_ip("-j", "route", "show") or "[]")
            if r.get("dst", "default") != "default"]
    subnets = list(NET.subnets(new_prefix=24))
    random.shuffle(subnets)
    for net in subnets:
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError(f"every /24 of {NET} is routed already; remove stale bridges")


class Network:
    """A bridge and one namespace per host name; `close()` removes everything it made."""

    def __init__(self, names: list[str]):
        reason = unavailable()
        if reason:
            raise Unavailable(reason)
        sweep_stale()
        self.tag = secrets.token_hex(3)
        self.bridge = f"bt{self.tag}br"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen] = []
        self._made: list[tuple[str, str]] = []
        """("link" | "netns", name) in the order made."""
        try:
            self._build(names)
        except BaseException:
            self.close()
            raise

    def _build(self, names: list[str]) -> None:
        net = _free_subnet()
        alias = f"baton-test-{os.getpid()}"
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("link", "set", self.bridge, "alias", alias)
        _ip("addr", "add", f"{net[254]}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.gateway = str(net[254])
        """The test process's own address on the bridge."""
        for i, name in enumerate(names):
            ns, link = f"{PREFIX}{os.getpid()}-{self.tag}-{name}", f"bt{self.tag}h{i}"
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._made.append(("link", link))
            _ip("link", "set", link, "alias", alias)
            _ip("link", "set", link, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{net[i + 1]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts[name] = Host(name, ns, str(net[i + 1]), link)

    def spawn(self, host: str, argv: list[str], env: dict[str, str], log: Path,
              cwd: Path | None = None) -> subprocess.Popen:
        """Run `argv` in `host`'s namespace (its PID is the program's: `ip netns exec` execs)."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].netns, *argv],
                                    env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        self.procs.append(proc)
        return proc

    def tx_bytes(self, host: str) -> int:
        """Bytes `host` sent onto its link (received by the bridge end of its veth)."""
        return int(Path(f"/sys/class/net/{self.hosts[host].link}/statistics/rx_bytes")
                   .read_text())

    def rx_bytes(self, host: str) -> int:
        """Bytes `host` received from its link (sent by the bridge end of its veth)."""
        return int(Path(f"/sys/class/net/{self.hosts[host].link}/statistics/tx_bytes")
                   .read_text())

    def listening(self, host: str) -> set[tuple[str, int]]:
        """(address, port) of every TCP socket listening in `host`'s namespace (IPv4-mapped
        addresses as IPv4)."""
        done = subprocess.run(["ip", "netns", "exec", self.hosts[host].netns, "ss", "-ltnH"],
                              capture_output=True, text=True, timeout=20, check=True)
        out = set()
        for line in done.stdout.splitlines():
            addr, _, port = line.split()[3].rpartition(":")
            addr = "0.0.0.0" if addr == "*" else addr.strip("[]").partition("%")[0]
            ip = ipaddress.ip_address(addr)
            mapped = getattr(ip, "ipv4_mapped", None)  # gRPC listens on ::ffff:a.b.c.d
            out.add((str(mapped or ip), int(port)))
        return out

    def rate_limit(self, host: str, rate: str | None) -> None:
        """Shape what `host` sends to `rate` (tc tbf, e.g. "16mbit"): a slow link; None
        removes the shaping."""
        ns = self.hosts[host].netns
        if rate is None:
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True, timeout=20)  # none set: nothing to remove
            return
        done = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev",
                               "eth0", "root", "tbf", "rate", rate, "burst", "32kb",
                               "latency", "200ms"], capture_output=True, text=True, timeout=20)
        if done.returncode:
            raise RuntimeError(f"tc tbf on {host}: {done.stderr.strip()}")

    def link_down(self, host: str) -> None:
        """Pull `host`'s cable: its packets and packets to it are dropped, nobody is told."""
        _ip("link", "set", self.hosts[host].link, "down")

    def link_up(self, host: str) -> None:
        """Plug it back: TCP connections that outlived the outage resume."""
        _ip("link", "set", self.hosts[host].link, "up")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # veths first: a namespace outlives its name while closed TCP connections in it still
        # retransmit (to a host whose link is down, for minutes), and its veth with it
        for kind, name in reversed(self._made):
            if kind == "link":
                _quiet("link", "del", name)
            else:
                _kill_netns_pids(name)  # anything a child left behind
                _quiet("netns", "del", name)
        self._made.clear()
