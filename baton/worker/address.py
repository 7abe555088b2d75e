"""The address a worker advertises and binds: the one configured, else the address of the
interface that routes to the router; its gRPC port: the first free one of the configured range."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

import grpc

from baton.config.ports import PortRange
from baton.errors import ConfigError

AUTO = ("", "auto")
"""`worker.host` values that mean: find the address yourself."""
SIOCGIFADDR = 0x8915
"""Linux ioctl: an interface's (primary) IPv4 address."""


def advertised_host(configured: str | None, router: str) -> str:
    """`configured` unless it is unset, "" or "auto"; else the source address of this host's
    route to `router` (HOST:PORT), which is 127.0.0.1 when the router is on loopback."""
    if configured is not None and configured.strip() not in AUTO:
        return configured.strip()
    host, port = split_host_port(router)
    return route_source(host, port)


def route_source(host: str, port: int) -> str:
    """The local address the kernel would send from to reach `host`. A UDP `connect()` only
    looks up the route: no packet leaves the host."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return s.getsockname()[0]
    except OSError as e:
        raise ConfigError(f"cannot find this host's address towards the router {host}:{port} "
                          f"({e}); check --router, or give the address to advertise with --host "
                          "(worker.host)") from None


def split_host_port(address: str) -> tuple[str, int]:
    """"HOST:PORT" or "[V6]:PORT" -> (host, port); a ConfigError names the address."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"router address {address!r} is not HOST:PORT (e.g. 10.0.0.5:50051)")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """"HOST:PORT", with brackets around an IPv6 address (gRPC and ZeroMQ both want them)."""
    try:
        v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        v6 = False
    return f"[{host}]:{port}" if v6 else f"{host}:{port}"


def interface_of(address: str) -> str | None:
    """The name of the local interface whose IPv4 address is `address` (None: no interface has
    it as its primary address, or it is not IPv4)."""
    try:
        packed = socket.inet_aton(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()))
            except OSError:  # no IPv4 address on this one
                continue
            if got[20:24] == packed:
                return name
    return None


def bind_grpc(server: grpc.Server, host: str, ports: PortRange,
              credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind `server` to the first free port of `ports` on `host` (TLS with `credentials`);
    the port bound. Make the server with `("grpc.so_reuseport", 0)`: with gRPC's default two
    servers share a port."""
    def add(port: int) -> int:
        address = join_host_port(host, port)
        bound = server.add_insecure_port(address) if credentials is None else \
            server.add_secure_port(address, credentials)
        if not bound:  # older grpcio answers 0 instead of raising
            raise OSError(f"cannot bind {join_host_port(host, port)}")
        return bound

    return ports.bind(add, "worker.port")
