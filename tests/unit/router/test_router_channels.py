"""The router keeps one long-lived channel per worker: requests reuse it, a move replaces it."""

from __future__ import annotations

from dataclasses import replace

from baton.config.router import RouterConfig
from baton.contract import Role, WorkerLoad, WorkerView
from router.worker_client import WorkerClients


def view(worker_id: str, address: str, inflight: int = 0) -> WorkerView:
    return WorkerView(worker_id, Role.DECODE, address, 16, WorkerLoad(), inflight)


def test_every_request_to_a_worker_uses_its_one_channel():
    clients = WorkerClients(RouterConfig())
    try:
        first = clients(view("d0", "127.0.0.1:1"))
        # a later view of the same worker (new load, in flight) is the same worker
        assert clients(view("d0", "127.0.0.1:1", inflight=5)) is first
        assert clients(view("d1", "127.0.0.1:2")) is not first
        assert len(clients._clients) == 2
    finally:
        clients.close()


def test_a_worker_back_at_a_new_address_gets_a_new_channel():
    clients = WorkerClients(RouterConfig())
    try:
        old = clients(view("d0", "127.0.0.1:1"))
        old_channel = clients._clients["d0"][1]
        moved = clients(replace(view("d0", "127.0.0.1:1"), address="127.0.0.1:3"))
        assert moved is not old and clients._clients["d0"][0] == "127.0.0.1:3"
        assert old_channel is not clients._clients["d0"][1]
    finally:
        clients.close()
