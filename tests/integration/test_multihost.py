"""A cluster across hosts: router, 2 prefill and 2 decode hosts, each its own network namespace
on one bridge (tests/support/netns.py), every role started with the `baton` CLI and no --host.

KV moves over UCX TCP (`transfer.ucx_tls: tcp`): UCX takes namespaces of one kernel for one
node and would copy with cma, never touching a link. One cluster for the module; the failure
tests change it, so they run last (the prefill link stays down to the end).
"""

from __future__ import annotations

import signal
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from baton.client.local import run_local
from baton.client.remote import run_remote, to_pb
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.proto_gen import baton_pb2, router_pb2_grpc
from bench.harness.netns import Network, Unavailable, unavailable
from bench.harness.netns_cluster import METRICS_PORT, NetnsCluster
from tests.integration.cluster_helpers import assert_clean, list_workers, write_config
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = pytest.mark.integration

HOSTS = ("router", "prefill0", "prefill1", "decode0", "decode1")
EJECT_S = 2.0
CONFIG = {
    "cache": {"num_blocks": 1024, "num_state_slots": 48},
    "router": {"policy": "round_robin", "heartbeat_seconds": 0.25, "eject_after_seconds": EJECT_S,
               "prefill_timeout_seconds": 60.0},
    "worker": {"max_num_seqs": 16, "max_model_len": 4096, "port": "50100-50109"},
    "transfer": {"ucx_tls": "tcp", "lease_seconds": 8.0, "handshake_timeout_s": 3.0,
                 "side_channel_port": "50200-50209", "ucx_port": "50300-50309"},
}
"""Every port a worker opens is in a range a firewall could allow (METRICS_PORT aside)."""


def _interrupt(*_):
    raise KeyboardInterrupt


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(f"multi-host tests skipped: {reason}")
    root = tmp_path_factory.mktemp("multihost")
    model = make_checkpoint(root)
    config = write_config(root / "baton.yaml", CONFIG)
    # SIGTERM (CI timeouts) unwinds like Ctrl-C, so the finalizer below still cleans up
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        net = Network(list(HOSTS))
    except Unavailable as e:
        signal.signal(signal.SIGTERM, previous)
        pytest.skip(f"multi-host tests skipped: {e}")
    try:
        cluster = NetnsCluster(net, model, config, root)
        workers = cluster.wait_ready(4, timeout=120)
        ids = {_host_of(net, w.address): w.worker_id for w in workers}
        yield SimpleNamespace(net=net, cluster=cluster, model=model, ids=ids,
                              config=BatonConfig.from_dict(CONFIG))
    finally:
        net.close()
        signal.signal(signal.SIGTERM, previous)


def _host_of(net: Network, address: str) -> str:
    ip = address.rpartition(":")[0]
    return next(h for h, host in net.hosts.items() if host.address == ip)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def local(hosts, specs):
    return tokens(run_local(build_engine(hosts.config, str(hosts.model)), specs, len(specs)))


def tokens(results):
    return {r["id"]: r.get("token_ids", r.get("error")) for r in results}


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def test_workers_without_host_advertise_their_own_hosts_address(hosts):
    workers = list_workers(hosts.cluster.address)
    roles = {baton_pb2.WORKER_ROLE_PREFILL: "prefill", baton_pb2.WORKER_ROLE_DECODE: "decode"}
    got = sorted((roles[w.role], w.address.rpartition(":")[0]) for w in workers)
    net = hosts.net
    assert got == sorted((h.rstrip("01"), net.hosts[h].address) for h in HOSTS[1:])
    assert {w.address.rpartition(":")[2] for w in workers} == {"50100"}


def test_workers_listen_only_on_their_address_and_configured_ports(hosts):
    """What a firewall between hosts must allow: nothing outside the configured ports, and
    nothing on another interface (over TCP alone UCX keeps to the advertised one)."""
    ucx = set(range(50300, 50310))
    for h in HOSTS[1:]:
        mine = hosts.net.hosts[h].address
        seen = hosts.net.listening(h)
        expected = {(mine, 50100), (mine, METRICS_PORT)}
        if h.startswith("decode"):
            expected.add((mine, 50200))  # the side channel
        outside = {(a, p) for a, p in seen if (a, p) not in expected and p not in ucx}
        assert not outside, (h, seen)
        assert expected <= seen, (h, seen)
        assert {a for a, p in seen if p in ucx} == {mine}, (h, seen)


def test_16_concurrent_requests_equal_local_and_the_kv_crosses_the_prefill_links(hosts):
    net, cluster = hosts.net, hosts.cluster
    specs = [RequestSpec(f"m{i}", prompt_ids=prompt(i, 40 + 29 * i), sampling=greedy(8))
             for i in range(16)]
    prefill, decode = ("prefill0", "prefill1"), ("decode0", "decode1")
    handoff = {h: cluster.metric(h, "baton_handoff_bytes_sum") for h in prefill}
    sent = {h: net.tx_bytes(h) for h in prefill}
    received = {h: net.rx_bytes(h) for h in decode}
    remote = run_remote(cluster.address, specs, concurrency=16)
    assert tokens(remote) == local(hosts, specs)
    assert {r["prefill_worker"] for r in remote} == {hosts.ids[h] for h in prefill}
    assert {r["decode_worker"] for r in remote} == {hosts.ids[h] for h in decode}
    moved = {h: cluster.metric(h, "baton_handoff_bytes_sum") - handoff[h] for h in prefill}
    on_link = {h: net.tx_bytes(h) - sent[h] for h in prefill}
    for h in prefill:  # every handoff byte left its prefill host over its link, not by cma
        assert moved[h] > 0 and on_link[h] >= moved[h], (h, moved, on_link)
    landed = sum(net.rx_bytes(h) - received[h] for h in decode)
    assert landed >= sum(moved.values()), (landed, moved)
    assert_clean(cluster)


class Stream:
    """One Generate stream read in a thread: tokens, then the summary or the error."""

    def __init__(self, address: str, spec: RequestSpec):
        self.tokens: list[int] = []
        self.code = self.details = self.ended = None
        self.decode_worker = self.retries = None
        self._thread = threading.Thread(target=self._run, args=(address, spec), daemon=True)
        self._thread.start()

    def _run(self, address: str, spec: RequestSpec) -> None:
        with grpc.insecure_channel(address) as ch:
            try:
                for msg in router_pb2_grpc.RouterStub(ch).Generate(to_pb(spec), timeout=60):
                    self.tokens.extend(msg.token_ids)
                    self.decode_worker = msg.decode_worker or self.decode_worker
                    if msg.finish_reason:
                        self.retries = msg.retries
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                self.code, self.details = e.code(), e.details()
        self.ended = time.monotonic()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a stream outlived every timeout"


def test_a_decode_host_whose_link_goes_down_mid_stream(hosts):
    """Its streams move to the other decode host once the router ejects it (a new pair prefills
    prompt + the tokens sent): every stream ends with exactly the local tokens, the moved ones
    soon after eject_after_seconds (not TCP's minutes); back up, it rejoins and every worker is
    idle and consistent again."""
    net, cluster = hosts.net, hosts.cluster
    # 3,000 tokens: still streaming when the link goes down, however late the last stream
    # starts (the tiny model streams ~1,000 tokens/s a stream on the Zen 4; 600 tokens were
    # once all sent by a pair that started a second before the other pair under CI's load,
    # and 1,900 twice this session while the other pytest worker ran beside it)
    specs = [RequestSpec(f"d{i}", prompt_ids=prompt(700 + i, 60), sampling=greedy(3000))
             for i in range(4)]
    expected = local(hosts, specs)
    streams = [Stream(cluster.address, s) for s in specs]
    wait_until(lambda: all(len(s.tokens) >= 3 for s in streams), 60, "every stream started")
    down = time.monotonic()
    net.link_down("decode0")
    try:
        for s in streams:
            s.join(EJECT_S + 30)
    finally:
        net.link_up("decode0")
    assert [(s.code, s.details) for s in streams] == [(grpc.StatusCode.OK, None)] * 4
    for spec, s in zip(specs, streams, strict=True):
        assert s.tokens == expected[spec.id] and s.decode_worker == hosts.ids["decode1"]
    moved = [s for s in streams if s.retries]
    assert len(moved) == 2 and all(s.retries == 1 for s in moved)
    for s in moved:
        assert s.ended - down < EJECT_S + 20.0, s.ended - down  # not TCP's minutes
    wait_until(lambda: len(list_workers(cluster.address)) == 4, 30, "decode0 registered again")
    assert_clean(cluster)


def test_a_prefill_host_whose_link_goes_down_mid_transfer(hosts):
    """Runs last. prefill0's requests are retried on prefill1 once the router ejects it, with
    exact tokens; the decode side freed what the cut transfers held, except the blocks a cut
    transfer may still write: those stay quarantined until its bytes landed, after the link
    came back (they used to land in freed blocks seconds later)."""
    net, cluster = hosts.net, hosts.cluster
    specs = [RequestSpec(f"p{i}", prompt_ids=prompt(900 + i, 1500), sampling=greedy(4))
             for i in range(4)]
    expected = local(hosts, specs)
    net.rate_limit("prefill0", "16mbit")  # a 1,500-token handoff then takes about 1 s
    before = net.tx_bytes("prefill0")
    results = {}
    runner = threading.Thread(
        target=lambda: results.update(r=run_remote(cluster.address, specs, concurrency=4)))
    runner.start()
    wait_until(lambda: net.tx_bytes("prefill0") - before > 200_000, 60, "KV leaving prefill0")
    down = time.monotonic()
    net.link_down("prefill0")
    runner.join(EJECT_S + 30)
    assert not runner.is_alive(), "a request outlived every timeout"
    took = time.monotonic() - down
    assert tokens(results["r"]) == expected
    assert {r["prefill_worker"] for r in results["r"]} == {hosts.ids["prefill1"]}
    assert took < EJECT_S + 8.0, took  # not prefill_timeout_seconds (60)
    live = {w.worker_id for w in list_workers(cluster.address)}
    assert live == {hosts.ids[h] for h in ("prefill1", "decode0", "decode1")}
    held = assert_clean(cluster, quarantine=True)  # survivors idle, integrity exact
    # the cut transfers had been granted: their blocks are out of service, not free
    assert sum(c["quarantined_total"] for c in held.values()) >= 1, held
    assert sum(c["blocks_quarantined"] for c in held.values()) > 0, held
    net.link_up("prefill0")  # the held-up bytes land now, in the quarantined blocks only,
    # and then the blocks are returned: after TCP's next retransmission, whose timer doubled
    # through the outage (retries ~6, 13, 25 s after the cut), so up to ~13 s after the link
    # came back, then the bytes at 16 mbit: 15 s was once too short on a fresh clone (2
    # quarantines, 188 blocks still held; the likely cause, not confirmed)
    assert_clean(cluster, within=60.0)
