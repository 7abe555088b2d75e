"""`baton router`: the router role as its own process (gRPC and the OpenAI-compatible HTTP API)."""

from __future__ import annotations

import signal
import threading

from baton.config import BatonConfig


def run_router_role(args) -> int:
    from baton.model.chat_template import load_chat_template
    from baton.model.config import ModelConfig
    from baton.model.registry import resolve_model, served_name
    from baton.model.tokenizer import load_tokenizer
    from router.http.server import start_http
    from router.server import run_router

    cfg = BatonConfig.load(args.config)
    model_dir = resolve_model(args.model or cfg.model.path)
    handle = run_router(args.port, cfg.router, load_tokenizer(model_dir))
    max_len = cfg.worker.max_model_len or ModelConfig.from_dir(model_dir).max_position_embeddings
    http_port = cfg.router.http_port if args.http_port is None else args.http_port
    try:
        http = start_http(handle, cfg.router.host, http_port, served_name(model_dir),
                          load_chat_template(model_dir), max_len)
    except BaseException:
        handle.stop()
        raise
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    host = cfg.router.host
    print(f"router serving gRPC on {host}:{handle.port} and HTTP on http://{host}:{http.port}",
          flush=True)
    stop.wait()
    http.stop()
    handle.stop()
    return 0


def run_prefill_worker(args) -> int:
    from prefill_worker.main import run

    return run(args)


def run_decode_worker(args) -> int:
    from decode_worker.main import run

    return run(args)
