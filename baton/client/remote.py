"""`baton generate --router`: streams each request through the router's Generate."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import grpc.experimental

from baton.auth.api_keys import ENV_API_KEY
from baton.auth.grpc_auth import open_channel
from baton.client.requests import RequestSpec, result_dict
from baton.contract import GenerateInput, wire
from baton.errors import InvalidRequestError
from baton.proto_gen import router_pb2_grpc
from baton.worker import phases


def to_input(spec: RequestSpec) -> GenerateInput:
    ids = tuple(spec.prompt_ids) if spec.prompt_ids is not None else None
    text = None if ids is not None else (spec.prompt or "")
    return GenerateInput(spec.id, ids, text, spec.sampling, spec.session or "")


CHANNEL_OPTIONS = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
"""Generate streams are read on the thread that asked, not handed over by the channel's own
thread: one thread switch less before the first token (issue 53)."""

WIRE_RANGES = "max_tokens and top_k below 2^32, seed below 2^64, token ids below 2^31"


def to_pb(spec: RequestSpec):
    """The GenerateRequest for one request spec; InvalidRequestError naming the field for a value
    the router would refuse or the protocol cannot hold."""
    spec.sampling.validate()
    try:
        return wire.generate_to_pb(to_input(spec))
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"a value does not fit the protocol ({e}): {WIRE_RANGES}") from e


def generate_one(stub: router_pb2_grpc.RouterStub, spec: RequestSpec, timeout: float = 600) -> dict:
    """The spec's result (its first sample's when n > 1)."""
    return generate_samples(stub, spec, timeout)[0]


def generate_samples(stub: router_pb2_grpc.RouterStub, spec: RequestSpec,
                     timeout: float = 600) -> list[dict]:
    """The spec's result, or one per sample (each with its `index`) when n > 1."""
    n = spec.sampling.n
    accs = [_acc(spec) for _ in range(n)]
    t0 = time.perf_counter()
    try:
        req = to_pb(spec)
    except InvalidRequestError as e:
        return [{"id": spec.id, "error": f"invalid request: {e}"}]
    try:
        call = stub.Generate(req, timeout=timeout)
        for msg in call:
            last = wire.chunk_from_pb(msg)
            acc = accs[last.sample]
            acc["token_ids"].extend(last.token_ids)
            acc["text"].append(last.text)
            if "logprobs" in acc:
                acc["logprobs"].extend(last.logprobs)
            if "prompt_logprobs" in acc and last.prompt_logprobs:
                acc["prompt_logprobs"] = list(last.prompt_logprobs)
            acc["summary"] = last.summary
    except grpc.RpcError as e:
        return [{"id": spec.id, "error": f"{e.code().name}: {e.details()}"}]
    # where the time to first token went (a disaggregated request's; baton/worker/phases.py)
    measured = phases.durations(phases.from_metadata(call.trailing_metadata()))
    out = [_result(spec.id, acc, t0) for acc in accs]
    for r in out:
        if measured and "error" not in r:
            r["phases_ms"] = measured
    if n > 1:
        for i, r in enumerate(out):
            r["index"] = i
    return out


def _acc(spec: RequestSpec) -> dict:
    acc: dict = {"token_ids": [], "text": [], "summary": None}
    if spec.sampling.logprobs is not None:
        acc["logprobs"] = []
    if spec.sampling.prompt_logprobs is not None:
        acc["prompt_logprobs"] = []
    return acc


def _result(spec_id: str, acc: dict, t0: float) -> dict:
    s = acc.pop("summary")
    if s is None:
        return {"id": spec_id, "error": "stream ended without a finish reason"}
    acc.update(
        finish_reason=s.finish_reason.value,
        prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
        ttft_ms=s.ttft_ms, latency_ms=s.latency_ms or (time.perf_counter() - t0) * 1000,
    )
    if s.draft_tokens:  # the decode worker speculated
        acc.update(draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens)
    return result_dict(spec_id, acc, "".join(acc.pop("text")), s.prefill_worker,
                       s.decode_worker)


def run_remote(router: str, specs: list[RequestSpec], concurrency: int = 1,
               credentials: grpc.ChannelCredentials | None = None) -> list[dict]:
    """Requests in file order, at most `concurrency` in flight; sessions keep their order.
    `BATON_API_KEY` in the environment is sent as the API key (routers with keys need it);
    `credentials`: TLS towards the router (baton/auth/tls.py), None: plaintext."""
    key = os.environ.get(ENV_API_KEY, "").strip() or None
    with open_channel(router, key, credentials, CHANNEL_OPTIONS) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        if concurrency <= 1:
            return [r for s in specs for r in generate_samples(stub, s)]
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return [r for rs in pool.map(lambda s: generate_samples(stub, s), specs) for r in rs]
