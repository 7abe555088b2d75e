"""Keeps a worker registered with the router: Register, then Heartbeat with load and snapshot events."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

import grpc

from baton.auth.grpc_auth import open_channel
from baton.contract import SnapshotEvent, WorkerInfo, WorkerLoad, wire
from baton.proto_gen import router_pb2, router_pb2_grpc

log = logging.getLogger("baton.worker")


class Registration:
    """Heartbeats in a thread; re-registers (reporting every snapshot again) when asked."""

    def __init__(self, router: str, info: WorkerInfo, load: Callable[[], WorkerLoad],
                 snapshot_events: Callable[[bool], list[SnapshotEvent]],
                 bearer: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None):
        self.worker_id = info.worker_id
        self._info = info
        self._load = load
        self._events = snapshot_events
        self._channel = open_channel(router, bearer, credentials)
        self._stub = router_pb2_grpc.RegistryStub(self._channel)
        self._period = 1.0
        self._pending: list[SnapshotEvent] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self, timeout: float = 60.0) -> None:
        """Register (retrying until the router answers or `timeout`), then heartbeat."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)
        self._register()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self._stub.Deregister(router_pb2.DeregisterRequest(worker_id=self.worker_id), timeout=2)
        except grpc.RpcError:
            pass
        self._channel.close()

    def _register(self) -> None:
        msg = wire.register_to_pb(replace(self._info, load=self._load()))
        reply = self._stub.Register(msg, timeout=10)
        self._period = reply.heartbeat_seconds or 1.0
        self._pending = list(self._events(True))
        log.info("registered %s with the router (heartbeat %.1fs)", self.worker_id, self._period)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                events = self._pending + list(self._events(False))
                self._pending = []
                reply = self._stub.Heartbeat(
                    router_pb2.HeartbeatRequest(
                        worker_id=self.worker_id, load=wire.load_to_pb(self._load()),
                        snapshot_events=[wire.event_to_pb(e) for e in events],
                    ),
                    timeout=max(5.0, self._period * 4),
                )
                if reply.reregister:
                    self._register()
            except grpc.RpcError as e:
                log.warning("heartbeat to router failed: %s", e.code())
                self._pending = events
