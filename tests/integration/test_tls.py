"""TLS: a cluster (router + 1 prefill + 1 decode, real processes) with mutual TLS between its
processes (`cluster.tls_*`) and a public router certificate (`router.tls_*`), all issued by a
CA made for the test.

It serves the colocated engine's tokens over gRPC and HTTPS to a client that holds only the CA;
plaintext is refused on every port; a worker refuses a client without a certificate of the
cluster CA even when it holds the cluster secret; without `router.tls_*` the router's own port
is mutual TLS too.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import grpc
import pytest

from baton.auth.grpc_auth import open_channel
from baton.auth.tls import ClusterTls, cluster_tls
from baton.cli import main
from baton.client.local import run_local
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.config.cluster import ClusterConfig
from baton.config.router import RouterConfig
from baton.contract import GenerateInput, wire
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import router_pb2_grpc as rgrpc
from baton.proto_gen import worker_pb2_grpc as wgrpc
from router.server import run_router
from tests.integration.cluster_helpers import start_cluster, write_config
from tests.support.engine_helpers import make_checkpoint, prompt
from tests.support.tls import issue, make_ca

pytestmark = pytest.mark.integration

CONFIG = {
    "cache": {"num_blocks": 128, "num_state_slots": 24},
    "worker": {"max_num_seqs": 4, "max_model_len": 256},
    "router": {"heartbeat_seconds": 0.5, "eject_after_seconds": 30.0},
}
SAMPLING = SamplingParams(max_tokens=6, ignore_eos=True)
REFUSED = grpc.StatusCode.UNAVAILABLE
"""What a failed TLS handshake ends a call with."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root)
    return {"root": root, "ca": ca, "node": issue(ca, root, "node"),
            "public": issue(ca, root, "router-public"), "stranger_ca": make_ca(root, "other-ca")}


def tls_of(pki, node) -> ClusterTls:
    return cluster_tls(ClusterConfig(tls_cert_file=str(node.cert), tls_key_file=str(node.key),
                                     tls_ca_file=str(pki["ca"].cert)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, pki):
    root = tmp_path_factory.mktemp("tls")
    model = make_checkpoint(root)
    node, public = pki["node"], pki["public"]
    cfg = {**CONFIG,
           "router": {**CONFIG["router"], "tls_cert_file": str(public.cert),
                      "tls_key_file": str(public.key)},
           "cluster": {"tls_cert_file": str(node.cert), "tls_key_file": str(node.key),
                       "tls_ca_file": str(pki["ca"].cert)}}
    config = write_config(root / "baton.yaml", cfg)
    cluster = start_cluster(model, config, prefill=1, decode=1)
    try:
        with public_channel(pki, cluster.address) as ch:
            listed = rgrpc.RouterStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=10)
        yield {"cluster": cluster, "model": model, "config": config,
               "workers": {w.role: w.address for w in listed.workers}}
    finally:
        cluster.stop()


def public_channel(pki, address: str) -> grpc.Channel:
    """A public client: trusts the CA, has no certificate of its own."""
    creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"].cert.read_bytes())
    return open_channel(address, None, creds)


def local_tokens(setup, ids) -> list[int]:
    engine = build_engine(BatonConfig.from_dict(CONFIG), str(setup["model"]))
    (res,) = run_local(engine, [RequestSpec("ref", prompt_ids=ids, sampling=SAMPLING)])
    return res["token_ids"]


def stats_code(role: int, address: str, bearer: str, credentials) -> grpc.StatusCode:
    stub = wgrpc.PrefillWorkerStub if role == pb.WORKER_ROLE_PREFILL else wgrpc.DecodeWorkerStub
    with open_channel(address, bearer, credentials) as ch:
        try:
            stub(ch).Stats(pb.StatsRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_tls_cluster_serves_exact_tokens_over_grpc_and_https(setup, pki):
    ids = prompt(21, 30)
    req = wire.generate_to_pb(GenerateInput("tls-1", tuple(ids), None, SAMPLING))
    with public_channel(pki, setup["cluster"].address) as ch:
        msgs = list(rgrpc.RouterStub(ch).Generate(req, timeout=60))
    expected = local_tokens(setup, ids)
    assert [t for m in msgs for t in m.token_ids] == expected
    assert setup["cluster"].http_address.startswith("https://")
    body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{setup['cluster'].http_address}/v1/completions",
                                     data=body, headers={"Content-Type": "application/json"})
    context = ssl.create_default_context(cafile=str(pki["ca"].cert))
    with urllib.request.urlopen(request, timeout=60, context=context) as r:
        assert json.loads(r.read())["choices"][0]["token_ids"] == expected


def test_baton_generate_speaks_tls_as_its_config_says(setup, capsys):
    ids = prompt(22, 12)
    argv = ["generate", "--router", setup["cluster"].address, "--config", str(setup["config"]),
            "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "5", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    engine = build_engine(BatonConfig.from_dict(CONFIG), str(setup["model"]))
    sampling = SamplingParams(max_tokens=5, temperature=0.0)
    (ref,) = run_local(engine, [RequestSpec("ref", prompt_ids=ids, sampling=sampling)])
    assert got == ref["token_ids"]


def test_plaintext_is_refused_on_every_port(setup):
    bearer = setup["cluster"].secret.bearer
    with open_channel(setup["cluster"].address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            rgrpc.RouterStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=5)
    assert e.value.code() == REFUSED
    for role, address in setup["workers"].items():
        assert stats_code(role, address, bearer, None) == REFUSED
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        plain = setup["cluster"].http_address.replace("https://", "http://")
        urllib.request.urlopen(f"{plain}/health", timeout=5).read()


def test_workers_refuse_a_client_without_a_cluster_certificate(setup, pki):
    bearer = setup["cluster"].secret.bearer  # the secret alone is not enough under mutual TLS
    ca_only = grpc.ssl_channel_credentials(root_certificates=pki["ca"].cert.read_bytes())
    stranger = issue(pki["stranger_ca"], pki["root"], "stranger")
    foreign = grpc.ssl_channel_credentials(
        root_certificates=pki["ca"].cert.read_bytes(), private_key=stranger.key.read_bytes(),
        certificate_chain=stranger.cert.read_bytes())
    member = tls_of(pki, issue(pki["ca"], pki["root"], "member")).channel_credentials()
    for role, address in setup["workers"].items():
        assert stats_code(role, address, bearer, ca_only) == REFUSED
        assert stats_code(role, address, bearer, foreign) == REFUSED
        assert stats_code(role, address, bearer, member) == grpc.StatusCode.OK


def test_without_a_router_certificate_the_router_port_is_mutual_tls(pki):
    tls = tls_of(pki, pki["node"])
    handle = run_router(0, RouterConfig(host="127.0.0.1"), cluster_tls=tls)
    try:
        ca_only = grpc.ssl_channel_credentials(root_certificates=pki["ca"].cert.read_bytes())
        for creds, code in ((None, REFUSED), (ca_only, REFUSED),
                            (tls.channel_credentials(), grpc.StatusCode.OK)):
            with open_channel(handle.address, None, creds) as ch:
                try:
                    rgrpc.RouterStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=5)
                    got = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    got = e.code()
            assert got == code, creds
    finally:
        handle.stop(grace=0)
