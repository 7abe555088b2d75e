"""Cluster secret, API keys, sealed side channel, signed reservations, registry takeover."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import zmq

from baton.auth import ClusterSecret, load_secret
from baton.auth.api_keys import load_api_keys
from baton.auth.reservations import sign_reservation, verify_reservation
from baton.auth.tls import cluster_tls, router_tls
from baton.config import BatonConfig
from baton.config.cluster import ClusterConfig
from baton.config.router import RouterConfig
from baton.contract import Reservation, Role, WorkerInfo
from baton.errors import ConfigError, NotPermittedError, TransferError
from baton.model.pools import Pools
from router.registry import Registry
from tests.support.tls import issue, make_ca
from tests.unit.transfer.test_transfer_leases import MODEL, Link, make, poll_until
from transfer import SIDE_CHANNEL, wire
from transfer.base import TransferEvent
from transfer.fingerprint import compute_fingerprint
from transfer.receiver import Receiver
from transfer.sender import Sender

TOKEN = "s3cret-token-of-the-test-cluster"
SECRET = ClusterSecret(TOKEN)


# ---- the secret ---------------------------------------------------------------------------

def test_secret_comes_from_env_or_file_and_must_agree(tmp_path):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    from_file = load_secret(ClusterConfig(token_file=str(f)), environ={})
    from_env = load_secret(ClusterConfig(), environ={"BATON_CLUSTER_TOKEN": TOKEN})
    assert from_file.bearer == from_env.bearer == SECRET.bearer
    both = load_secret(ClusterConfig(token_file=str(f)), environ={"BATON_CLUSTER_TOKEN": TOKEN})
    assert both.bearer == SECRET.bearer
    with pytest.raises(ConfigError, match="hold different secrets"):
        load_secret(ClusterConfig(token_file=str(f)), environ={"BATON_CLUSTER_TOKEN": "x" * 20})
    f.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_secret(ClusterConfig(token_file=str(f)), environ={})
    with pytest.raises(ConfigError, match="cannot be read"):
        load_secret(ClusterConfig(token_file=str(tmp_path / "missing")), environ={})
    with pytest.raises(ConfigError, match="has 5 characters, fewer than 16"):
        ClusterSecret("short")


def test_no_secret_is_a_loud_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="baton.auth"):
        assert load_secret(ClusterConfig(), environ={}, role="decode worker") is None
    assert "NO CLUSTER SECRET: this decode worker accepts internal calls" in caplog.text


def test_derived_keys_differ_per_purpose_and_never_equal_the_token():
    keys = {SECRET.key(p) for p in ("grpc-bearer", SIDE_CHANNEL, "reservation")}
    assert len(keys) == 3
    assert TOKEN not in SECRET.bearer and len(SECRET.bearer) == 64
    assert ClusterSecret(TOKEN + "x").bearer != SECRET.bearer
    assert len(ClusterSecret.generate()) >= 40


def test_tls_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="cluster.tls_cert_file is set but cluster.tls_key_file, "
                                          "cluster.tls_ca_file is not"):
        BatonConfig.from_dict({"cluster": {"tls_cert_file": "/x.pem"}})
    with pytest.raises(ConfigError, match="router.tls_key_file is set but router.tls_cert_file"):
        BatonConfig.from_dict({"router": {"tls_key_file": "/x.key"}})
    assert BatonConfig.from_dict({"cluster": {"token_file": "/t"}}).cluster.token_file == "/t"
    ca = make_ca(tmp_path)
    node, other = issue(ca, tmp_path, "node"), issue(ca, tmp_path, "other")
    def cfg(cert, key, ca):
        return ClusterConfig(tls_cert_file=str(cert), tls_key_file=str(key), tls_ca_file=str(ca))

    with pytest.raises(ConfigError, match="cluster.tls_ca_file .*missing.pem.* cannot be read"):
        cluster_tls(cfg(node.cert, node.key, tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="cluster.tls_cert_file .* holds no PEM certificate"):
        cluster_tls(cfg(node.key, node.key, ca.cert))
    with pytest.raises(ConfigError, match="router.tls_key_file .* is not the private key of"):
        router_tls(RouterConfig(tls_cert_file=str(node.cert), tls_key_file=str(other.key)))
    tls = cluster_tls(cfg(node.cert, node.key, ca.cert))
    assert tls.ca == ca.cert.read_bytes() and tls.own.cert == node.cert.read_bytes()
    assert router_tls(RouterConfig()) is None and cluster_tls(ClusterConfig()) is None


def test_api_keys_from_file_and_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# ops\nkey-number-one\n\n  key-number-two  \n")
    assert load_api_keys(str(f), {}) == {"key-number-one", "key-number-two"}
    assert load_api_keys("", {"BATON_API_KEY": "env-key-123"}) == {"env-key-123"}
    assert load_api_keys("", {}) == frozenset()
    f.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_api_keys(str(f), {})
    with pytest.raises(ConfigError, match="shorter than 8"):
        load_api_keys("", {"BATON_API_KEY": "abc"})


# ---- signed reservations ------------------------------------------------------------------

RES = Reservation("decode-1", "tcp://10.0.0.2:4000", (7, 8, 9), 2, skip_blocks=1,
                  lease_seconds=30.0, incarnation="ab12")


def test_a_signed_reservation_verifies_only_exactly_as_issued():
    signed = sign_reservation(SECRET, "req-a", RES)
    assert len(signed.signature) == 32
    verify_reservation(SECRET, "req-a", signed)
    altered = [
        replace(signed, block_ids=(7, 8, 10)), replace(signed, block_ids=(7, 8)),
        replace(signed, slot=3), replace(signed, slot=None), replace(signed, skip_blocks=0),
        replace(signed, lease_seconds=3000.0), replace(signed, worker_id="decode-2"),
        replace(signed, transfer_endpoint="tcp://10.0.0.9:4000"),
        replace(signed, incarnation="ab13"),
    ]
    for bad in altered:
        with pytest.raises(NotPermittedError, match="does not match its signature"):
            verify_reservation(SECRET, "req-a", bad)
    with pytest.raises(NotPermittedError, match="does not match its signature"):
        verify_reservation(SECRET, "req-b", signed)  # another request's reservation
    with pytest.raises(NotPermittedError, match="does not match its signature"):
        verify_reservation(ClusterSecret("another-cluster-secret"), "req-a", signed)
    with pytest.raises(NotPermittedError, match="carries no signature"):
        verify_reservation(SECRET, "req-a", RES)


def test_without_a_secret_nothing_is_signed_or_checked():
    assert sign_reservation(None, "r", RES) == RES
    verify_reservation(None, "r", RES)


# ---- the sealed side channel --------------------------------------------------------------

KEY = SECRET.key(SIDE_CHANNEL)


@pytest.fixture
def sealed():
    link = Link()
    cfg, spec, rc, sc = make(link)
    fp = compute_fingerprint(MODEL, spec)
    r = Receiver(cfg, Pools(spec), fp, "127.0.0.1", rc, key=KEY)
    yield link, cfg, spec, sc, fp, r
    r.close()


def dealer(endpoint: str):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_sealed_handoff_completes(sealed):
    link, cfg, spec, sc, fp, r = sealed
    s = Sender(cfg, Pools(spec), fp, sc, key=KEY)
    try:
        r.expect("a", [2, 3], 1, lease_s=5)
        s.send("a", r.endpoint, [0, 1], 0, [2, 3], 1, incarnation=r.incarnation)
        assert poll_until(s) == [TransferEvent("a", True, None)]
        assert poll_until(r) == [TransferEvent("a", True, None)]
    finally:
        s.close()


def test_unsealed_and_wrongly_sealed_messages_are_dropped_unanswered(sealed):
    link, cfg, spec, sc, fp, r = sealed
    r.expect("victim", [2, 3], 1, lease_s=5)
    sock = dealer(r.endpoint)
    try:
        other = ClusterSecret("another-cluster-secret").key(SIDE_CHANNEL)
        for data in (wire.encode("hello", fingerprint=fp, backend="fake"),
                     wire.encode("abort", rid="victim", error="x"),
                     wire.encode("posted", rid="victim"),
                     wire.seal(wire.encode("abort", rid="victim", error="x"), other),
                     wire.seal(wire.encode("hello", fingerprint=fp, backend="fake"), other),
                     b"garbage", b""):
            sock.send(data)
        assert not sock.poll(300)  # no welcome, no refusal: nothing to learn
    finally:
        sock.close()
    assert r._listener.unauthenticated == 7 and r._listener.rejected == 0
    assert r.pending == ["victim"] and r.poll() == []  # the abort changed nothing
    s = Sender(cfg, Pools(spec), fp, sc, key=KEY)
    try:  # the reservation still works for the real sender
        s.send("victim", r.endpoint, [0, 1], 0, [2, 3], 1)
        assert poll_until(r) == [TransferEvent("victim", True, None)]
    finally:
        s.close()


def test_a_sender_with_another_secret_gets_no_handshake(sealed):
    link, _, spec, sc, fp, r = sealed
    cfg = make(link)[0]
    s = Sender(replace(cfg, handshake_timeout_s=0.3), Pools(spec), fp, sc,
               key=ClusterSecret("another-cluster-secret").key(SIDE_CHANNEL))
    try:
        with pytest.raises(TransferError, match="does it hold the same cluster secret"):
            s.connect(r.endpoint)
    finally:
        s.close()


def test_refusals_name_the_field_never_the_decode_side_value(sealed):
    link, cfg, spec, sc, fp, r = sealed
    sock = dealer(r.endpoint)
    try:
        odd = {**fp, "dtype": "float16", "tokens_per_block": 99}
        sock.send(wire.seal(wire.encode("hello", fingerprint=odd, backend="fake"), KEY))
        assert sock.poll(3000)
        reply = wire.decode(wire.unseal(sock.recv(), KEY), 1 << 20)
    finally:
        sock.close()
    assert reply["op"] == "refused" and reply["field"] == "dtype"
    assert "float32" not in reply["error"] and "16" not in reply["error"], reply


def test_the_sender_names_its_own_value_in_a_refusal():
    link = Link()
    cfg, spec, rc, sc = make(link)
    import torch

    _, spec16, _, _ = make(link, dtype=torch.float16)
    r = Receiver(cfg, Pools(spec), compute_fingerprint(MODEL, spec), "127.0.0.1", rc, key=KEY)
    s = Sender(cfg, Pools(spec16), compute_fingerprint(MODEL, spec16), sc, key=KEY)
    try:
        with pytest.raises(TransferError) as e:
            s.connect(r.endpoint)
        assert "field 'dtype'" in str(e.value) and "(this prefill worker has 'float16')" in \
            str(e.value) and "float32" not in str(e.value)
    finally:
        s.close()
        r.close()


def test_a_reservation_from_another_incarnation_sends_nothing(sealed):
    link, cfg, spec, sc, fp, r = sealed
    s = Sender(cfg, Pools(spec), fp, sc, key=KEY)
    try:
        r.expect("old", [2, 3], 1, lease_s=5)
        s.send("old", r.endpoint, [0, 1], 0, [2, 3], 1, incarnation="0123456789abcdef")
        (ev,) = poll_until(s)
        assert not ev.ok and "another incarnation of the decode worker" in ev.error
        assert link.posts == []  # nothing was posted
    finally:
        s.close()


# ---- the registry -------------------------------------------------------------------------

def test_a_live_worker_id_cannot_move_to_another_address():
    now = [100.0]
    reg = Registry(5.0, clock=lambda: now[0])
    reg.register(WorkerInfo("d0", Role.DECODE, "10.0.0.2:5000"))
    with pytest.raises(NotPermittedError, match="'d0' is registered and live at another"):
        reg.register(WorkerInfo("d0", Role.DECODE, "10.6.6.6:5000"))
    assert reg.get("d0").address == "10.0.0.2:5000"
    reg.register(WorkerInfo("d0", Role.DECODE, "10.0.0.2:5000"))  # re-registering is fine
    now[0] += 5.5  # silent past eject_after_seconds: the id is free again
    reg.register(WorkerInfo("d0", Role.DECODE, "10.0.0.3:5000"))
    assert reg.get("d0").address == "10.0.0.3:5000"
