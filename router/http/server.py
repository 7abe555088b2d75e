"""Serves the HTTP app with uvicorn on a thread of the router process, beside gRPC."""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from baton.errors import BatonError
from baton.model.chat_template import ChatTemplate
from router.http.app import HttpContext, make_app

log = logging.getLogger("baton.http")


class HttpServer:
    """A running HTTP API: `port` and `stop()`."""

    def __init__(self, ctx: HttpContext, host: str, port: int, ssl: dict | None = None):
        self._ctx = ctx
        self._sock = _bind(host, port)
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(make_app(ctx), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1, **(ssl or {}))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="router-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise BatonError(f"the HTTP API did not start on {host}:{self.port} within 30s")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._ctx.pool.shutdown(wait=False, cancel_futures=True)
        self._sock.close()


def start_http(router, host: str, port: int, model_name: str, chat_template: ChatTemplate | None,
               max_model_len: int, api_keys: frozenset[str] = frozenset(),
               ssl: dict | None = None, weights: dict | None = None) -> HttpServer:
    """The OpenAI-compatible API for a running router (`router.server.RouterHandle`); `ssl`:
    uvicorn's TLS arguments (baton/auth/tls.py `http_ssl_args`)."""
    cfg = router.orchestrator.config
    pool = ThreadPoolExecutor(max_workers=cfg.server_threads, thread_name_prefix="http-request")
    ctx = HttpContext(router.orchestrator, router.metrics, model_name, chat_template,
                      max_model_len, cfg.http_max_body_bytes, pool, api_keys, weights)
    server = HttpServer(ctx, host, port, ssl)
    log.info("HTTP%s API on %s:%d (model %s)", "S" if ssl else "", host, server.port, model_name)
    return server


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, as asyncio's own servers bind: only then does it set TCP_NODELAY on
    # accepted connections (without it, Nagle + delayed ACKs add ~40 ms to streamed tokens)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise BatonError(f"the HTTP API could not bind {host}:{port} ({e}); set router.http_port "
                         f"or --http-port to a free port") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
