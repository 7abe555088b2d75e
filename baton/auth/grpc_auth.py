"""gRPC edges of authentication: a server interceptor and a client channel that sends a bearer.

    ServerGuard(tokens={"baton.v1.Registry": {...}}, default=None)
        service -> accepted bearer tokens (None: open to anyone); `default` for the rest.
        Refused calls end with UNAUTHENTICATED before their request is even parsed, so they
        change nothing. Every call whose message cannot be parsed ends with INVALID_ARGUMENT
        (gRPC's own answer would be INTERNAL).
    authorized(channel, token) -> a channel whose every call carries `authorization: Bearer`.
    open_channel(address, token, credentials) -> the same over TLS when `credentials` are given
        (baton/auth/tls.py makes them), plaintext otherwise.
"""

from __future__ import annotations

import collections
import hmac
from collections.abc import Iterable, Mapping, Sequence

import grpc

HEALTH = "grpc.health.v1.Health"
"""Always open: load balancers and supervisors probe it without credentials."""


class ServerGuard(grpc.ServerInterceptor):
    def __init__(self, tokens: Mapping[str, Iterable[str] | None] | None = None,
                 default: Iterable[str] | None = None, hints: Mapping[str, str] | None = None):
        self._tokens = {k: _frozen(v) for k, v in (tokens or {}).items()}
        self._tokens.setdefault(HEALTH, None)
        self._default = _frozen(default)
        self._hints = dict(hints or {})

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return handler
        service = details.method.strip("/").split("/")[0]
        accepted = self._tokens.get(service, self._default)
        if accepted is not None and not _presented(details.invocation_metadata, accepted):
            hint = self._hints.get(service, "the cluster secret (BATON_CLUSTER_TOKEN or "
                                             "cluster.token_file, the same on every process)")
            return _deny(handler, f"{service} needs credentials: send `authorization: Bearer "
                                  f"<token>` with {hint}")
        return _parse_safely(handler, details.method)


def authorized(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel` with `authorization: Bearer <token>` on every call (unchanged when None)."""
    return channel if not token else grpc.intercept_channel(channel, _Bearer(token))


def open_channel(address: str, token: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to `address` (TLS with `credentials`, else plaintext) that sends `token`."""
    if credentials is None:
        channel = grpc.insecure_channel(address, options=list(options))
    else:
        channel = grpc.secure_channel(address, credentials, options=list(options))
    return authorized(channel, token)


def _frozen(tokens: Iterable[str] | None) -> frozenset[str] | None:
    return None if tokens is None else frozenset(tokens)


def _presented(metadata, accepted: frozenset[str]) -> bool:
    given = next((v for k, v in metadata or () if k == "authorization"), "")
    if not isinstance(given, str) or not given.startswith("Bearer "):
        return False
    token = given[len("Bearer "):].encode()
    # compare with every accepted token, so the time taken does not say which one matched
    return any([hmac.compare_digest(token, t.encode()) for t in accepted])


def _kind(handler) -> str:
    return (f"{'stream' if handler.request_streaming else 'unary'}_"
            f"{'stream' if handler.response_streaming else 'unary'}")


def _deny(handler, why: str):
    def refuse(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    # no deserializer: an unauthenticated caller's bytes are never parsed
    return handler._replace(request_deserializer=None, **{_kind(handler): refuse})


class _Unparsed:
    def __init__(self, error: str):
        self.error = error


def _parse_safely(handler, method: str):
    parse, behavior = handler.request_deserializer, getattr(handler, _kind(handler))
    if parse is None:
        return handler

    def safe(data):
        try:
            return parse(data)
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others
            return _Unparsed(f"{type(e).__name__}: {e}")

    def check(request, context):
        if isinstance(request, _Unparsed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the request to {method} is not a valid message ({request.error}); "
                          "send the message proto/baton/v1 defines for it")
        return request

    def checked(request, context):
        return behavior(check(request, context), context)

    def checked_stream(requests, context):
        return behavior((check(r, context) for r in requests), context)

    wrapped = checked_stream if handler.request_streaming else checked
    return handler._replace(request_deserializer=safe, **{_kind(handler): wrapped})


class _Details(
    collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression")),
    grpc.ClientCallDetails,
):
    pass


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self._pair = ("authorization", f"Bearer {token}")

    def _details(self, d) -> _Details:
        metadata = [*(d.metadata or ()), self._pair]
        return _Details(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready,
                        d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)
