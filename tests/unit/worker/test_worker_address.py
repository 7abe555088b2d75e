"""The address a worker advertises without --host, and ports given as ranges."""

from __future__ import annotations

import socket
from concurrent import futures

import grpc
import pytest

from baton.config import BatonConfig
from baton.config.ports import ANY_PORT, PortRange, port_range
from baton.errors import ConfigError
from baton.worker.address import (
    advertised_host,
    bind_grpc,
    interface_of,
    join_host_port,
    split_host_port,
)
from transfer.side_channel import Listener


@pytest.mark.parametrize("configured", [None, "", "auto", " auto "])
def test_auto_towards_a_loopback_router_is_loopback(configured):
    assert advertised_host(configured, "127.0.0.1:50051") == "127.0.0.1"


def test_configured_host_overrides_auto():
    assert advertised_host("10.1.2.3", "127.0.0.1:50051") == "10.1.2.3"


def test_auto_asks_the_route_to_the_router_for_its_source(monkeypatch):
    asked = []

    class FakeSocket:
        def __init__(self, family, kind):
            assert kind == socket.SOCK_DGRAM  # connect() of UDP sends nothing

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def connect(self, addr):
            asked.append(addr)

        def getsockname(self):
            return ("198.18.0.7", 40000)

    monkeypatch.setattr(socket, "socket", FakeSocket)
    assert advertised_host("auto", "198.18.0.1:50051") == "198.18.0.7"
    assert asked == [("198.18.0.1", 50051)]


def test_no_route_to_the_router_names_host_flag(monkeypatch):
    def unreachable(*_a, **_k):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    with pytest.raises(ConfigError, match=r"router 10\.9\.9\.9:50051 .*--host"):
        advertised_host(None, "10.9.9.9:50051")


@pytest.mark.parametrize("address, expected", [
    ("10.0.0.5:50051", ("10.0.0.5", 50051)),
    ("router.example:7", ("router.example", 7)),
    ("[fd00::5]:50051", ("fd00::5", 50051)),
])
def test_split_host_port(address, expected):
    assert split_host_port(address) == expected


@pytest.mark.parametrize("address", ["10.0.0.5", "10.0.0.5:", ":50051", "host:port"])
def test_bad_router_address_is_named(address):
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        split_host_port(address)


def test_join_host_port_brackets_ipv6_only():
    assert join_host_port("fd00::5", 80) == "[fd00::5]:80"
    assert join_host_port("10.0.0.5", 80) == "10.0.0.5:80"
    assert join_host_port("worker-3", 80) == "worker-3:80"


@pytest.mark.parametrize("value, expected", [
    (0, ANY_PORT), ("0", ANY_PORT), (50051, PortRange(50051, 50051)),
    ("50051", PortRange(50051, 50051)), ("50100-50199", PortRange(50100, 50199)),
    (" 7-7 ", PortRange(7, 7)), ("1-65535", PortRange(1, 65535)),
])
def test_port_range_forms(value, expected):
    assert port_range(value, "worker.port") == expected


@pytest.mark.parametrize("value", [-1, 65536, "5-1", "0-10", "a-b", "5-", "-5", "1-2-3", "",
                                   True, 1.5, "65535-65536"])
def test_bad_port_range_names_key_and_forms(value):
    with pytest.raises(ConfigError, match=r"^transfer\.ucx_port: .* is not a port; use 0"):
        port_range(value, "transfer.ucx_port")


def test_candidates_and_text():
    assert list(ANY_PORT.candidates()) == [0] and ANY_PORT.any and str(ANY_PORT) == "0"
    r = PortRange(5000, 5003)
    assert list(r.candidates()) == [5000, 5001, 5002, 5003] and str(r) == "5000-5003"
    assert str(PortRange(7, 7)) == "7" and not r.any


def test_bind_takes_the_first_free_port_in_order():
    taken = {5000, 5001}
    tried = []

    def bind(port):
        tried.append(port)
        if port in taken:
            raise OSError(98, "Address already in use")
        return port

    assert PortRange(5000, 5003).bind(bind, "worker.port") == 5002
    assert tried == [5000, 5001, 5002]
    with pytest.raises(ConfigError, match=r"worker\.port: no free port in 5000-5001 .*in use"):
        PortRange(5000, 5001).bind(bind, "worker.port")


def test_config_keys_take_ranges_and_refuse_bad_ones_by_name():
    cfg = BatonConfig.from_dict({"worker": {"port": "50100-50109"},
                                 "transfer": {"side_channel_port": 5600, "ucx_port": "7000-7099",
                                              "ucx_tls": "tcp"}})
    assert cfg.worker.ports == PortRange(50100, 50109)
    assert cfg.transfer.side_channel_ports == PortRange(5600, 5600)
    assert cfg.transfer.ucx_env == {"UCX_TLS": "tcp", "UCX_TCP_PORT_RANGE": "7000-7099"}
    assert BatonConfig.from_dict({}).transfer.ucx_env == {}
    assert BatonConfig.from_dict({}).worker.host == "auto"
    with pytest.raises(ConfigError, match=r"^transfer\.side_channel_port: '9-3' is not a port"):
        BatonConfig.from_dict({"transfer": {"side_channel_port": "9-3"}})
    with pytest.raises(ConfigError, match=r"^worker\.port: 70000 is not a port"):
        BatonConfig.from_dict({"worker": {"port": 70000}})


def _two_free_ports() -> tuple[socket.socket, int]:
    """A socket holding port P while P + 1 is free: (holder, P)."""
    for _ in range(50):
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                holder.close()
                continue
        holder.listen()
        return holder, port
    pytest.skip("no two consecutive free ports on 127.0.0.1")


def test_side_channel_binds_the_first_free_port_of_its_range():
    holder, port = _two_free_ports()
    with holder:
        listener = Listener("127.0.0.1", 1024, lambda ident, msg: None,
                            ports=PortRange(port, port + 1))
        try:
            assert listener.endpoint == f"tcp://127.0.0.1:{port + 1}"
        finally:
            listener.close()


def test_grpc_servers_on_one_host_never_share_a_port_of_a_range():
    holder, port = _two_free_ports()
    holder.close()  # both ports free: the first server takes P, the second must take P + 1
    servers = [grpc.server(futures.ThreadPoolExecutor(1), options=[("grpc.so_reuseport", 0)])
               for _ in range(3)]
    try:
        r = PortRange(port, port + 1)
        assert [bind_grpc(s, "127.0.0.1", r) for s in servers[:2]] == [port, port + 1]
        with pytest.raises(ConfigError, match=f"worker.port: no free port in {port}-{port + 1}"):
            bind_grpc(servers[2], "127.0.0.1", r)
    finally:
        for s in servers:
            s.stop(0)


def test_interface_of_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("::1") is None and interface_of("not-an-ip") is None


@pytest.mark.parametrize("tls, tcp_only", [
    ("tcp", True), ("tcp,self", True), (" tcp ", True), ("", False), ("sm,self", False),
    ("tcp,cma", False), ("rc,tcp", False), ("cuda_copy,tcp", False),
])
def test_tcp_only_is_tcp_and_nothing_else_that_moves_data(tls, tcp_only):
    assert BatonConfig.from_dict({"transfer": {"ucx_tls": tls}}).transfer.tcp_only is tcp_only
