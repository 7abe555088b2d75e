"""gRPC calls from the router to workers; turns RPC errors into the router's plain errors.

INVALID_ARGUMENT            -> InvalidRequestError (passed to the client unchanged, no retry)
FAILED_PRECONDITION (Serve) -> LocalPrefillDeclined (the request goes through a prefill worker)
RESOURCE_EXHAUSTED          -> WorkerBusy (another worker is tried, else the request queues)
cancelled by our client     -> RequestCancelled
any other status / timeout  -> WorkerFailed (retried on another pair before the first token)
worker ejected (silent)     -> its channel is closed: every call still waiting on it fails now
                               with WorkerFailed instead of waiting for TCP to give up (a host
                               whose link went down answers nothing, not even a reset)
worker process died         -> its connection drops; a probe (Stats) that finds nobody listening
                               (UNAVAILABLE) reports it lost at once (`on_lost`): the router
                               ejects it and cancels the prefills working for it
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc
import grpc.experimental

from baton.auth.grpc_auth import open_channel
from baton.config.router import RouterConfig
from baton.contract import (
    DecodeChunk,
    PrefillInput,
    PrefillResult,
    Reservation,
    ReserveInput,
    Role,
    ServeInput,
    SnapshotShipment,
    WorkerView,
    wire,
)
from baton.errors import (
    InvalidRequestError,
    LocalPrefillDeclined,
    RequestCancelled,
    WorkerBusy,
    WorkerFailed,
)
from baton.proto_gen import baton_pb2 as pb
from baton.proto_gen import worker_pb2 as wpb
from baton.proto_gen import worker_pb2_grpc as wgrpc
from baton.worker import phases
from router.cancellation import Cancellation

log = logging.getLogger(__name__)
_STUBS = {Role.PREFILL: wgrpc.PrefillWorkerStub, Role.DECODE: wgrpc.DecodeWorkerStub}
CHANNEL_OPTIONS = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
"""Decode streams are read on the thread that serves the request, not handed over by the
channel's spin thread: one thread switch less per message."""


class OpenCalls:
    """Worker calls the router holds open, by kind (`worker_streams`: Decode and Serve until
    gRPC let go of them; `prefill_calls`), for the debug gauge `baton_router_tracked`. A
    stream whose call state gRPC still holds after it ended stays counted: that is a leak."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {"worker_streams": 0, "prefill_calls": 0}

    def add(self, kind: str, n: int) -> None:
        with self._lock:
            self._counts[kind] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class GrpcWorkerClient:
    def __init__(self, view: WorkerView, channel: grpc.Channel, config: RouterConfig,
                 calls: OpenCalls | None = None):
        self.worker_id = view.worker_id
        self.config = config
        self.calls = calls or OpenCalls()
        self._stub = _STUBS[view.role](channel)
        self.ejected = False
        """Set before the router closes this worker's channel because it went silent."""
        self.lost = False
        """Set when its process was found dead: nothing to abort there any more."""

    def reserve(self, req: ReserveInput, cancel: Cancellation) -> Reservation:
        call = self._stub.Reserve
        msg = wire.reserve_to_pb(req)
        reply = self._unary("Reserve", call, msg, self.config.reserve_timeout_seconds, cancel)
        res = wire.reservation_from_pb(reply)
        return res if res.worker_id else replace(res, worker_id=self.worker_id)

    def start_prefill(self, req: PrefillInput, cancel: Cancellation) -> GrpcPrefillCall:
        """Opens the Prefill stream now: the worker computes while the router still reserves
        the destination, which `GrpcPrefillCall.finish` sends on the same stream."""
        return GrpcPrefillCall(self, req, cancel)

    def decode(
        self, request_id: str, first_token_id: int, cancel: Cancellation,
        more_first_token_ids: tuple[int, ...] = (),
    ) -> Iterator[DecodeChunk]:
        """`more_first_token_ids`: n > 1, the first tokens of samples 1.. ."""
        msg = wpb.DecodeRequest(request_id=request_id, first_token_id=first_token_id,
                                more_first_token_ids=more_first_token_ids)
        return self._chunks("Decode", self._stub.Decode, msg, request_id, cancel,
                            1 + len(more_first_token_ids))

    def _chunks(self, name: str, method, msg, request_id: str,
                cancel: Cancellation, samples: int = 1) -> Iterator[DecodeChunk]:
        """A stream of DecodeChunks (Decode, Serve) of `samples` samples, ended as `_end`
        says (finished once every sample's last chunk came)."""
        open_ = samples
        try:
            call = method(msg)
        except ValueError as e:  # the channel closed: the worker was ejected meanwhile
            raise self._closed(name, e) from e
        self.calls.add("worker_streams", 1)
        finished = False
        try:
            with cancel.hook(call.cancel):
                for m in call:
                    chunk = wire.decode_chunk_from_pb(m)
                    open_ -= chunk.finish_reason is not None
                    finished = open_ <= 0
                    yield chunk
        except grpc.RpcError as e:
            raise self._error(name, request_id, e, cancel) from e
        finally:
            if _end(call, finished):
                self.calls.add("worker_streams", -1)

    def alive(self) -> bool:
        """False when nothing answers at the worker's address (its process died); a slow or
        failing answer still counts as alive."""
        if self.lost:
            return False
        try:
            self._stub.Stats(pb.StatsRequest(), timeout=PROBE_TIMEOUT_S, wait_for_ready=False)
            return True
        except grpc.RpcError as e:
            return e.code() != grpc.StatusCode.UNAVAILABLE
        except ValueError:  # channel closed: ejected or gone
            return False

    def serve(self, req: ServeInput, cancel: Cancellation) -> Iterator[DecodeChunk]:
        """The whole request on this decode worker (conditional disaggregation)."""
        return self._chunks("Serve", self._stub.Serve, wire.serve_to_pb(req), req.request_id,
                            cancel, req.sampling.n)

    def hold_snapshot(self, req: ReserveInput, cancel: Cancellation) -> Reservation:
        """Decode worker: hold its snapshot of exactly `req.prompt_ids` for a pull."""
        reply = self._unary("HoldSnapshot", self._stub.HoldSnapshot, wire.reserve_to_pb(req),
                            self.config.reserve_timeout_seconds, cancel)
        res = wire.reservation_from_pb(reply)
        return res if res.worker_id else replace(res, worker_id=self.worker_id)

    def pull_snapshot(self, shipment: SnapshotShipment, cancel: Cancellation) -> int:
        """Prefill worker: read the held snapshot in and commit it; returns blocks read."""
        reply = self._unary("PullSnapshot", self._stub.PullSnapshot,
                            wire.shipment_to_pb(shipment),
                            shipment.source.lease_seconds + 5, cancel)
        return reply.blocks_pulled

    def abort(self, request_id: str, sample: int | None = None) -> bool:
        """`sample`: only that sample of a request with n > 1 (None: the whole request)."""
        if self.ejected or self.lost:
            return False  # unreachable (channel closed, or the process died): nothing to free
        try:
            reply = self._stub.Abort(
                pb.AbortRequest(request_id=request_id, sample=sample),
                timeout=self.config.abort_timeout_seconds
            )
            return reply.found
        except (grpc.RpcError, ValueError) as e:  # ValueError: channel closed at shutdown
            log.warning("Abort(%s) on worker %s failed: %s", request_id, self.worker_id, e)
            return False

    def _unary(self, what: str, call, msg, timeout: float, cancel: Cancellation):
        # Blocking calls (a cancellable .future() costs ~0.25 ms more each); a cancelled
        # request is ended by the orchestrator's Abort, which makes the worker fail the call.
        try:
            return call(msg, timeout=timeout)
        except grpc.RpcError as e:
            raise self._error(what, msg.request_id, e, cancel) from e
        except ValueError as e:
            raise self._closed(what, e) from e

    def _closed(self, what: str, e: ValueError) -> WorkerFailed:
        return WorkerFailed(self.worker_id, what, f"its channel is closed ({e}); it was ejected"
                            if self.ejected else f"its channel is closed ({e})")

    def _error(self, what: str, request_id: str, e: grpc.RpcError, cancel: Cancellation):
        if cancel.cancelled:
            return RequestCancelled(f"request {request_id} cancelled during {what}")
        if self.ejected:
            return WorkerFailed(self.worker_id, what, (
                f"it was ejected: no heartbeat for {self.config.eject_after_seconds:g} s "
                f"(router.eject_after_seconds); the call ended with {e.code().name}"))
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidRequestError(e.details())
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return WorkerBusy(self.worker_id, what, e.details())
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION and what == "Serve":
            return LocalPrefillDeclined(e.details())
        return WorkerFailed(self.worker_id, what, f"{e.code().name}: {e.details()}")


def _end(call, finished: bool) -> bool:
    """Ends a stream call; True once gRPC let go of it. A single-threaded stream
    (CHANNEL_OPTIONS) has no channel thread to complete it: until this thread has taken
    every event of the call, the channel keeps its call state (C call, completion queue,
    ~1 KiB) for good, cancelled or not.

    After its last chunk the worker ends the stream at once: its status is read here.
    Unfinished streams are cancelled (the worker frees the request), then drained: a
    cancelled call's remaining events complete at once, locally. A stream that failed
    with a status was read to its end already."""
    if finished:
        try:
            for _ in call:
                pass
        except grpc.RpcError:
            pass
    elif not (call.cancel() or call.cancelled()):
        return _released(call)
    return _drain(call)


def _drain(call) -> bool:
    """Takes an ended single-threaded call's outstanding events; True once none is left.
    gRPC has no public call for it (reading a cancelled call raises at once and leaves
    them), hence its internals: tests/unit/router/test_worker_streams.py fails if a gRPC release
    changes them."""
    consume = getattr(call, "_consume_next_event", None)
    while not _released(call):
        if consume is None:
            return False
        try:
            consume()
        except Exception:  # noqa: BLE001 - the channel closed under it: gRPC dropped it
            log.debug("draining an ended stream stopped", exc_info=True)
            return False
    return True


def _released(call) -> bool:
    """Whether no operation of `call` still waits for its event."""
    state = getattr(call, "_state", None)
    if state is None:
        return False
    with state.condition:
        return not state.due


class GrpcPrefillCall:
    """One Prefill stream: the request now, the destination when the decode side reserved it."""

    _END = object()

    def __init__(self, client: GrpcWorkerClient, req: PrefillInput, cancel: Cancellation):
        self._client, self._req, self._cancel = client, req, cancel
        self._dest: queue.SimpleQueue = queue.SimpleQueue()
        first = wire.prefill_to_pb(req)
        try:
            self._future = client._stub.Prefill.future(
                self._messages(first), timeout=client.config.prefill_timeout_seconds
            )
        except ValueError as e:  # the channel closed: the worker was ejected meanwhile
            raise client._closed("Prefill", e) from e
        client.calls.add("prefill_calls", 1)
        self._future.add_done_callback(lambda _: client.calls.add("prefill_calls", -1))

    def _messages(self, first):
        yield first
        if self._req.destination is None:
            dest = self._dest.get()
            if dest is not self._END:
                yield wire.destination_to_pb(dest)

    def finish(self, destination: Reservation | None) -> PrefillResult:
        """Send the destination (None if it was in the request) and wait for the first token."""
        if destination is not None:
            self._dest.put(destination)
        try:
            result = wire.prefill_result_from_pb(self._future.result())
            return replace(result, phases_ms=phases.from_metadata(
                self._future.trailing_metadata()))
        except grpc.RpcError as e:
            raise self._client._error("Prefill", self._req.request_id, e, self._cancel) from e
        except grpc.FutureCancelledError as e:  # `cancel()` ran meanwhile
            if self._cancel.cancelled:
                raise RequestCancelled(f"request {self._req.request_id} cancelled during "
                                       "Prefill") from e
            raise WorkerFailed(self._client.worker_id, "Prefill", "the call was cancelled") from e

    def cancel(self) -> None:
        """No destination will come (Reserve failed): end the stream; the worker aborts."""
        self._dest.put(self._END)
        self._future.cancel()


PROBE_TIMEOUT_S = 2.0
"""A liveness probe's deadline; only UNAVAILABLE (nobody listening) counts as dead: a slow
answer on a loaded host is no proof of death."""


class _Liveness:
    """Watches one worker's channel: when a READY connection drops, probes the worker once
    and reports it lost if nothing listens at its address any more (its process died)."""

    def __init__(self, worker_id: str, stub, on_lost: Callable[[str, str], None]):
        self.worker_id, self._stub, self._on_lost = worker_id, stub, on_lost
        self._ready = False
        self.closed = False

    def __call__(self, state: grpc.ChannelConnectivity) -> None:  # on gRPC's thread: no blocking
        if state == grpc.ChannelConnectivity.READY:
            self._ready = True
        elif self._ready and state in (grpc.ChannelConnectivity.IDLE,
                                       grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            self._ready = False
            threading.Thread(target=self._probe, name=f"probe-{self.worker_id}",
                             daemon=True).start()

    def _probe(self) -> None:
        try:
            self._stub.Stats(pb.StatsRequest(), timeout=PROBE_TIMEOUT_S, wait_for_ready=False)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and not self.closed:
                self._on_lost(self.worker_id, f"its connection dropped and nothing answers at "
                                              f"its address ({e.details()})")
        except ValueError:  # the channel closed meanwhile: the worker left already
            pass


class WorkerClients:
    """One channel per live worker, opened on first use and closed when the worker leaves."""

    def __init__(self, config: RouterConfig, bearer: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None):
        self.config = config
        self._bearer = bearer
        self._credentials = credentials
        """Mutual TLS towards the workers (cluster.tls_*; None: plaintext)."""
        """The cluster secret's bearer, sent on every worker call (None: no secret)."""
        self._lock = threading.Lock()
        self._clients: dict[str, tuple[str, grpc.Channel, GrpcWorkerClient]] = {}
        self._watches: dict[str, tuple[grpc.Channel, _Liveness]] = {}
        self.calls = OpenCalls()
        """Calls open on any worker (the debug gauge `baton_router_tracked`)."""
        self.on_lost: list[Callable[[str, str], None]] = []
        """Called with (worker id, why) when a worker's process is found dead."""

    def __call__(self, view: WorkerView) -> GrpcWorkerClient:
        with self._lock:
            entry = self._clients.get(view.worker_id)
            if entry is None or entry[0] != view.address:
                if entry is not None:
                    self._unwatch(view.worker_id)
                    _close_later(entry[1])
                channel = open_channel(view.address, self._bearer, self._credentials,
                                       CHANNEL_OPTIONS)
                entry = (view.address, channel,
                         GrpcWorkerClient(view, channel, self.config, self.calls))
                self._clients[view.worker_id] = entry
                watch = _Liveness(view.worker_id, entry[2]._stub, self._lost)
                self._watches[view.worker_id] = (channel, watch)
                channel.subscribe(watch)
            return entry[2]

    def _lost(self, worker_id: str, why: str) -> None:
        log.warning("worker %s lost: %s", worker_id, why)
        with self._lock:
            entry = self._clients.get(worker_id)
        if entry is not None:
            entry[2].lost = True
        for callback in self.on_lost:
            try:
                callback(worker_id, why)
            except Exception:  # noqa: BLE001 - the others must still hear of it
                log.exception("on_lost callback for %s failed", worker_id)

    def _unwatch(self, worker_id: str) -> None:
        """Lock held. gRPC's watching thread stops at its next poll (within 0.2 s)."""
        entry = self._watches.pop(worker_id, None)
        if entry is not None:
            channel, watch = entry
            watch.closed = True
            channel.unsubscribe(watch)

    def eject(self, worker_id: str) -> None:
        """The worker went silent: close its channel, which ends every call still waiting on
        it (they fail with WorkerFailed: retried before the first token, an error after)."""
        with self._lock:
            entry = self._clients.pop(worker_id, None)
            self._unwatch(worker_id)
        if entry is not None:
            entry[2].ejected = True
            entry[1].close()
            log.warning("worker %s ejected (silent for %g s); its calls in flight fail now",
                        worker_id, self.config.eject_after_seconds)

    def drop(self, worker_id: str) -> None:
        """Forgets the worker; requests still using its channel keep it open until they end."""
        with self._lock:
            self._clients.pop(worker_id, None)
            self._unwatch(worker_id)

    def close(self) -> None:
        with self._lock:
            entries, self._clients = list(self._clients.values()), {}
            for worker_id in list(self._watches):
                self._unwatch(worker_id)
        for _, channel, _ in entries:
            _close_later(channel)


WATCH_STOP_S = 0.5
"""gRPC's connectivity thread polls every 0.2 s and raises if its channel closed meanwhile:
a channel no call needs at once is closed this long after its watch was removed."""


def _close_later(channel: grpc.Channel) -> None:
    timer = threading.Timer(WATCH_STOP_S, channel.close)
    timer.daemon = True
    timer.start()
