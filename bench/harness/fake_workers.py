"""Scripted in-process prefill/decode worker servers, for router tests and benchmarks.

Tokens are predictable: the first token is `prompt_ids[-1] + 1`, and Decode streams
`first + 1, first + 2, ...` one per message until max_tokens (LENGTH) or a stop token (STOP).
With `Script.step_s` set, Decode instead plays an engine that makes one token every `step_s`
and, like the real decode worker, sends every token ready since its last message in one.
Every call is recorded, and `held` lists reservations neither decoded to the end nor aborted,
so tests can prove nothing leaks.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from enum import Enum

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.contract import (
    DecodeChunk,
    FinishReason,
    PrefillResult,
    Reservation,
    Role,
    SnapshotEvent,
    WorkerInfo,
    WorkerLoad,
    wire,
)
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import router_pb2 as rpb
from baton.proto_gen import router_pb2_grpc as rgrpc
from baton.proto_gen import worker_pb2_grpc as wgrpc


class Act(str, Enum):
    OK = "ok"
    FAIL = "fail"
    """Return UNAVAILABLE."""
    INVALID = "invalid"
    """Return INVALID_ARGUMENT (as a worker's own validation would)."""
    HANG = "hang"
    """Block until aborted or cancelled (Decode: after its first message)."""
    FINISH = "finish"
    """Prefill: the first token ends the request."""
    FAIL_MID = "fail_mid"
    """Decode: fail after its first message."""
    FULL = "full"
    """Return RESOURCE_EXHAUSTED (as a worker out of blocks or slots would)."""


@dataclass
class Script:
    reserve: Act = Act.OK
    prefill: Act = Act.OK
    decode: Act = Act.OK
    cached_tokens: int = 0
    token_delay_s: float = 0.0
    step_s: float = 0.0
    """Decode: a token every `step_s`, each message carrying all tokens ready (0 = one a message)."""
    drain: bool = True
    """With `step_s`: False sends one token a message, queueing the rest (the decode worker
    before it drained its queue into each message)."""
    hang_limit_s: float = 10.0
    capacity: int | None = None
    """Decode: reservations held at once; one more gets RESOURCE_EXHAUSTED (None: unbounded)."""
    server_threads: int = 16
    """gRPC server threads: one per concurrent stream."""
    decode_gate: threading.Barrier | None = None
    """Decode: each stream waits at this barrier (shared by the workers whose streams must
    overlap) before its first message; one that waits `hang_limit_s` breaks it."""


@dataclass
class FakeState:
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(method, request_id) in arrival order."""
    aborted: list[str] = field(default_factory=list)
    held: dict[str, Reservation] = field(default_factory=dict)
    """Reservations not yet released by a finished Decode or an Abort."""
    wake: dict[str, threading.Event] = field(default_factory=dict)
    max_held: int = 0
    """Most reservations held at once."""


class _Base:
    def __init__(self, worker_id: str, script: Script, state: FakeState, lock: threading.Lock):
        self.worker_id, self.script, self.state, self._lock = worker_id, script, state, lock

    def _record(self, method: str, request_id: str) -> threading.Event:
        with self._lock:
            self.state.calls.append((method, request_id))
            return self.state.wake.setdefault(request_id, threading.Event())

    def _act(self, act: Act, context, wake: threading.Event) -> None:
        if act == Act.FAIL:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id}: scripted failure")
        if act == Act.INVALID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{self.worker_id}: prompt too long")
        if act == Act.FULL:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.worker_id}: worker is full")
        if act == Act.HANG:
            context.add_callback(wake.set)
            wake.wait(self.script.hang_limit_s)
            context.abort(grpc.StatusCode.ABORTED, f"{self.worker_id}: aborted while hanging")

    def Abort(self, request, context):
        with self._lock:
            self.state.calls.append(("Abort", request.request_id))
            self.state.aborted.append(request.request_id)
            found = self.state.held.pop(request.request_id, None) is not None
            self.state.wake.setdefault(request.request_id, threading.Event()).set()
        return pb.AbortReply(found=found)

    def Stats(self, request, context):
        return pb.StatsReply(worker_id=self.worker_id)


class FakePrefill(_Base, wgrpc.PrefillWorkerServicer):
    def Prefill(self, request_iterator, context):
        # like a real worker, it needs the destination (the stream's second message) before
        # it can hand anything off: the call counts from then on
        inp = wire.prefill_from_pb(next(request_iterator))
        if inp.destination is None:
            nxt = next(request_iterator, None)
            if nxt is None or wire.destination_from_pb(nxt) is None:
                context.abort(grpc.StatusCode.CANCELLED, "Prefill stream ended without a destination")
        wake = self._record("Prefill", inp.request_id)
        self._act(self.script.prefill, context, wake)
        first = inp.prompt_ids[-1] + 1
        reason = _finish(1, first, inp.sampling)
        if self.script.prefill == Act.FINISH:
            reason = FinishReason.STOP
        result = PrefillResult(first, self.script.cached_tokens, reason is not None, reason)
        return wire.prefill_result_to_pb(result)


class FakeDecode(_Base, wgrpc.DecodeWorkerServicer):
    def __init__(self, *args):
        super().__init__(*args)
        self.sampling: dict[str, object] = {}

    def Reserve(self, request, context):
        wake = self._record("Reserve", request.request_id)
        self._act(self.script.reserve, context, wake)
        inp = wire.reserve_from_pb(request)
        n_blocks = -(-len(inp.prompt_ids) // 16)
        res = Reservation(self.worker_id, f"tcp://{self.worker_id}", tuple(range(n_blocks)), 0)
        with self._lock:
            if inp.request_id in self.state.held:  # as the real engine refuses a live id
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request id {inp.request_id!r} is already in use")
            cap = self.script.capacity
            if cap is not None and len(self.state.held) >= cap:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.worker_id}: decode worker is full ({cap} requests)")
            self.state.held[inp.request_id] = res
            self.state.max_held = max(self.state.max_held, len(self.state.held))
            self.sampling[inp.request_id] = inp.sampling
        return wire.reservation_to_pb(res)

    def Decode(self, request, context):
        rid = request.request_id
        wake = self._record("Decode", rid)
        if self.script.decode_gate is not None:
            self.script.decode_gate.wait(self.script.hang_limit_s)
        sampling = self.sampling[rid]
        token, sent = request.first_token_id, 1  # the first token came from Prefill
        for i, ready in enumerate(self._ready_counts(sampling.max_tokens), 1):
            tokens, reason = [], None
            while sent < ready and reason is None:
                token, sent = token + 1, sent + 1
                tokens.append(token)
                reason = _finish(sent, token, sampling)
            if reason is not None:
                with self._lock:
                    self.state.held.pop(rid, None)
            yield wire.decode_chunk_to_pb(DecodeChunk(tuple(tokens), reason))
            if reason is not None:
                return
            if i == 1 and self.script.decode != Act.OK:
                self._act(
                    Act.FAIL if self.script.decode == Act.FAIL_MID else self.script.decode,
                    context,
                    wake,
                )


    def _ready_counts(self, max_tokens: int):
        """Yields, before each message, how many tokens (first one included) exist by then."""
        step, n = self.script.step_s, 1
        if not step:
            for n in range(2, max_tokens + 1):
                if self.script.token_delay_s:
                    time.sleep(self.script.token_delay_s)
                yield n
            return
        t0 = time.perf_counter()
        while n < max_tokens:
            now = time.perf_counter()
            ready = min(max_tokens, 1 + int((now - t0) / step))
            if ready > n:
                n = ready if self.script.drain else n + 1
                yield n
            else:
                time.sleep(t0 + n * step - now)


def _finish(n_tokens: int, token: int, sampling) -> FinishReason | None:
    if token in sampling.stop_token_ids:
        return FinishReason.STOP
    return FinishReason.LENGTH if n_tokens >= sampling.max_tokens else None


_IDLE = WorkerLoad()
_SERVICERS = {
    Role.PREFILL: (FakePrefill, wgrpc.add_PrefillWorkerServicer_to_server),
    Role.DECODE: (FakeDecode, wgrpc.add_DecodeWorkerServicer_to_server),
}


class FakeWorker:
    """A fake worker process in this process: its own gRPC server on a free port."""

    def __init__(self, role: Role, worker_id: str, script: Script | None = None):
        self.role, self.worker_id = role, worker_id
        self.script = script or Script()
        self.state = FakeState()
        self._lock = threading.Lock()
        cls, add = _SERVICERS[role]
        self.servicer = cls(worker_id, self.script, self.state, self._lock)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.script.server_threads)
        )
        add(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"
        self._router: rgrpc.RegistryStub | None = None
        self._channel: grpc.Channel | None = None

    def calls(self, method: str | None = None) -> list[tuple[str, str]]:
        with self._lock:
            return [c for c in self.state.calls if method is None or c[0] == method]

    def register(self, router_address: str, load: WorkerLoad = _IDLE, tpb: int = 16,
                 max_model_len: int = 0):
        self._channel = grpc.insecure_channel(router_address)
        self._router = rgrpc.RegistryStub(self._channel)
        info = WorkerInfo(self.worker_id, self.role, self.address, tpb, load, max_model_len)
        return self._router.Register(wire.register_to_pb(info))

    def heartbeat(self, load: WorkerLoad = _IDLE, events: tuple[SnapshotEvent, ...] = ()):
        return self._router.Heartbeat(
            rpb.HeartbeatRequest(
                worker_id=self.worker_id,
                load=wire.load_to_pb(load),
                snapshot_events=[wire.event_to_pb(e) for e in events],
            )
        )

    def stop(self) -> None:
        self.server.stop(None).wait()
        if self._channel is not None:
            self._channel.close()


def health_status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
