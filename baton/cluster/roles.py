"""`baton router`: the router role as its own process."""

from __future__ import annotations

import signal
import threading
from dataclasses import replace

from baton.config import BatonConfig
from baton.worker.exit import exit_now


def run_router_role(args) -> int:
    from baton.auth import load_secret
    from baton.auth.api_keys import load_api_keys
    from baton.model.registry import resolve_model
    from baton.model.tokenizer import load_tokenizer
    from router.server import run_router

    cfg = BatonConfig.load(args.config)
    router_cfg = cfg.router if args.host is None else replace(cfg.router, host=args.host)
    secret = load_secret(cfg.cluster, role="router")
    api_keys = load_api_keys(router_cfg.api_keys_file)
    tokenizer = load_tokenizer(resolve_model(args.model or cfg.model.path))
    handle = run_router(args.port, router_cfg, tokenizer, secret, api_keys)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"router serving on {router_cfg.host}:{handle.port}", flush=True)
    stop.wait()
    handle.stop(grace=0.5)
    exit_now(0)


def run_prefill_worker(args) -> int:
    from prefill_worker.main import run

    return run(args)


def run_decode_worker(args) -> int:
    from decode_worker.main import run

    return run(args)
