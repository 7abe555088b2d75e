"""The weight format and bytes are visible: the engine-ready line, Stats counters,
`baton_model_weight_bytes{format}`, `/v1/models`; and the P/D handshake refuses two workers
serving different formats of one model."""

from __future__ import annotations

import http.client
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from baton.config import BatonConfig
from baton.config.router import RouterConfig
from baton.contract import Role
from baton.engine.builder import build_engine
from baton.engine.loop import EngineLoop
from baton.errors import TransferError
from baton.model.config import load_config
from baton.model.make_model import write_checkpoint
from baton.model.quant.served import checkpoint_bytes, resident_bytes, served_weights
from baton.model.tokenizer import ByteTokenizer
from baton.worker.load import counters_of
from baton.worker.metrics import WorkerMetrics
from bench import quant_layouts
from router.http.app import HttpContext
from router.http.server import HttpServer
from router.metrics import RouterMetrics
from router.registry import Registry
from transfer.fingerprint import check, compute_fingerprint

QWEN = dict(family="qwen3_5", pattern="G*", vocab_size=300, hidden_size=128,
            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vis")
    src = write_checkpoint(root / "bf", seed=1, **QWEN)
    return src, quant_layouts.write(src, root / "fp8", "qwen_fp8")


def test_engine_stats_and_metrics_name_the_format(dirs, caplog):
    _, fp8 = dirs
    cfg = BatonConfig.load(None)
    with caplog.at_level(logging.INFO, logger="baton"):
        engine = build_engine(cfg, str(fp8))
    w = engine.weights
    # the fp8 projections stay packed; what the checkpoint keeps in bf16 is held in float32
    assert w.format == "fp8_block128x128" and w.dtype == "packed fp8 and float32"
    assert w.bytes == resident_bytes(engine.model) > checkpoint_bytes(fp8)
    ready = [r.getMessage() for r in caplog.records if "engine ready" in r.getMessage()]
    assert ready and f"weights fp8_block128x128 ({w.bytes / 1e6:.1f} MB held in {w.dtype})" \
        in ready[0]
    loop = EngineLoop(engine)
    try:
        counters = counters_of(loop)
        assert counters["weight_bytes"] == w.bytes
        assert counters["weight_format.fp8_block128x128"] == 1.0
        text = generate_latest(WorkerMetrics(Role.DECODE, loop).registry).decode()
        samples = [(x.labels, x.value) for fam in text_string_to_metric_families(text)
                   if fam.name == "baton_model_weight_bytes" for x in fam.samples]
        assert samples == [({"role": "decode", "format": "fp8_block128x128"}, float(w.bytes))]
    finally:
        loop.stop()


def test_quantize_at_load_is_the_served_format(dirs):
    src, fp8 = dirs
    cfg = BatonConfig.from_dict({"model": {"quantize": "int4"}})
    assert build_engine(cfg, str(src)).weights.format == "w4a16_g32"
    # (under TP / PP too: tests/integration/test_quant_cluster.py)
    with pytest.raises(Exception, match="already quantized \\(fp8_block128x128\\)"):
        build_engine(cfg, str(fp8))


def test_handshake_refuses_workers_serving_different_formats(dirs):
    src, fp8 = dirs
    from baton.model.pools import PoolSpec

    model = load_config(src)
    spec = PoolSpec.for_model(model, num_blocks=4, tokens_per_block=16, num_slots=2)
    bf = compute_fingerprint(model, spec, weight_format=served_weights(src)["weight_format"])
    f8 = compute_fingerprint(load_config(fp8), spec,
                             weight_format=served_weights(fp8)["weight_format"])
    assert bf["model"] == f8["model"]  # one model: only the weight format tells them apart
    with pytest.raises(TransferError, match="'weight_format' differs .*'float32'.*"
                                            "'fp8_block128x128'"):
        check(bf, f8)
    check(f8, dict(f8))
    check(f8, {k: v for k, v in f8.items() if k != "weight_format"})  # a rank without it


def test_v1_models_lists_format_and_bytes(dirs):
    _, fp8 = dirs
    orch = SimpleNamespace(config=RouterConfig(), registry=Registry(5.0),
                           tokenizer=ByteTokenizer())
    ctx = HttpContext(orch, RouterMetrics(orch.registry), "m", None, max_model_len=64,
                      max_body_bytes=4096, pool=ThreadPoolExecutor(2),
                      weights=served_weights(fp8))
    server = HttpServer(ctx, "127.0.0.1", 0)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        conn.request("GET", "/v1/models")
        card = json.loads(conn.getresponse().read())["data"][0]
        conn.close()
    finally:
        server.stop()
    assert card["weight_format"] == "fp8_block128x128"
    assert card["checkpoint_bytes"] == checkpoint_bytes(fp8) > 0


def test_a_sender_of_another_weight_format_is_refused_at_connect():
    # the handshake itself (Receiver / Sender over the side channel): fp8 and bf16 workers of
    # one model never exchange a byte
    from baton.model.pools import Pools
    from tests.unit.transfer.test_transfer_leases import MODEL, Link, make
    from transfer.receiver import Receiver
    from transfer.sender import Sender

    cfg, spec, rc, sc = make(Link())
    r = Receiver(cfg, Pools(spec), compute_fingerprint(MODEL, spec, weight_format="bfloat16"),
                 "127.0.0.1", rc)
    s = Sender(cfg, Pools(spec), compute_fingerprint(MODEL, spec, weight_format="nvfp4"), sc)
    try:
        with pytest.raises(TransferError) as e:
            s.connect(r.endpoint)
        assert "field 'weight_format'" in str(e.value) and "nvfp4" in str(e.value), e.value
    finally:
        s.close()
        r.close()


def test_quantize_flag_on_serve_router_and_workers(capsys):
    from baton.cli import build_parser
    from baton.cluster.local import _worker_flags
    from baton.worker.host import _worker_config

    parser = build_parser()
    serve = parser.parse_args(["serve", "--quantize", "int8"])
    assert _worker_flags(serve) == ("--quantize", "int8")
    assert parser.parse_args(["router", "--quantize", "int4"]).quantize == "int4"
    for role, r in (("prefill-worker", Role.PREFILL), ("decode-worker", Role.DECODE)):
        args = parser.parse_args([role, "--router", "h:1", "--quantize", "int4"])
        assert _worker_config(args, r).model.quantize == "int4"
        args = parser.parse_args([role, "--router", "h:1"])
        assert _worker_config(args, r).model.quantize is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantize", "int3"])
    assert "invalid choice: 'int3' (choose from" in capsys.readouterr().err
