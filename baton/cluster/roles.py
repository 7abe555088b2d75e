"""`baton router`: the router role as its own process (gRPC and the OpenAI-compatible HTTP API)."""

from __future__ import annotations

from dataclasses import replace

from baton.config import BatonConfig
from baton.worker.exit import StopSignals, exit_now, timed_stop


def run_router_role(args) -> int:
    from baton.auth import load_secret
    from baton.auth.api_keys import load_api_keys
    from baton.auth.tls import cluster_tls, http_ssl_args, router_tls
    from baton.model.chat_template import load_chat_template
    from baton.model.config import load_config
    from baton.model.quant.served import served_weights
    from baton.model.registry import resolve_model, served_name
    from baton.model.tokenizer import load_tokenizer
    from router.http.server import start_http
    from router.server import run_router

    cfg = BatonConfig.load(args.config)
    router_cfg = cfg.router if args.host is None else replace(cfg.router, host=args.host)
    secret = load_secret(cfg.cluster, role="router")
    api_keys = load_api_keys(router_cfg.api_keys_file)
    model_dir = resolve_model(args.model or cfg.model.path)
    tls = cluster_tls(cfg.cluster)
    handle = run_router(args.port, router_cfg, load_tokenizer(model_dir), secret, api_keys, tls)
    max_len = cfg.worker.max_model_len or load_config(model_dir).max_position_embeddings
    http_port = router_cfg.http_port if args.http_port is None else args.http_port
    ssl_args = http_ssl_args(router_tls(router_cfg), tls)
    try:
        http = start_http(handle, router_cfg.host, http_port, served_name(model_dir),
                          load_chat_template(model_dir), max_len, api_keys, ssl_args,
                          weights=served_weights(model_dir, getattr(args, "quantize", None)
                                                 or cfg.model.quantize))
    except BaseException:
        handle.stop()
        raise
    stop = StopSignals()
    host = router_cfg.host
    print(f"router serving gRPC on {host}:{handle.port} and HTTP on "
          f"http{'s' if ssl_args else ''}://{host}:{http.port}",
          flush=True)
    stop.wait()
    timed_stop("router", [("http", http.stop), ("grpc", lambda: handle.stop(grace=0.5))])
    exit_now(0)


def run_prefill_worker(args) -> int:
    from prefill_worker.main import run

    return run(args)


def run_decode_worker(args) -> int:
    from decode_worker.main import run

    return run(args)
