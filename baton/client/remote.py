"""`baton generate --router`: streams each request through the router's Generate."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from baton.client.requests import RequestSpec, result_dict
from baton.proto_gen import baton_pb2, router_pb2, router_pb2_grpc
from router.wire import sampling_to_pb

FINISH_NAMES = {
    baton_pb2.FINISH_REASON_LENGTH: "length",
    baton_pb2.FINISH_REASON_STOP: "stop",
    baton_pb2.FINISH_REASON_ABORT: "abort",
}


def to_pb(spec: RequestSpec) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(
        request_id=spec.id, sampling=sampling_to_pb(spec.sampling), session_id=spec.session or ""
    )
    if spec.prompt_ids is not None:
        req.prompt_ids.extend(spec.prompt_ids)
    else:
        req.prompt = spec.prompt or ""
    return req


def generate_one(stub: router_pb2_grpc.RouterStub, spec: RequestSpec, timeout: float = 600) -> dict:
    acc = {"token_ids": []}
    text = []
    t0 = time.perf_counter()
    try:
        last = None
        for msg in stub.Generate(to_pb(spec), timeout=timeout):
            acc["token_ids"].extend(msg.token_ids)
            text.append(msg.text)
            last = msg
        if last is None or last.finish_reason == baton_pb2.FINISH_REASON_UNSPECIFIED:
            return {"id": spec.id, "error": "stream ended without a finish reason"}
    except grpc.RpcError as e:
        return {"id": spec.id, "error": f"{e.code().name}: {e.details()}"}
    acc.update(
        finish_reason=FINISH_NAMES.get(last.finish_reason, "unknown"),
        prompt_tokens=last.prompt_tokens, cached_tokens=last.cached_tokens,
        ttft_ms=last.ttft_ms, latency_ms=last.latency_ms or (time.perf_counter() - t0) * 1000,
    )
    return result_dict(spec.id, acc, "".join(text), last.prefill_worker, last.decode_worker)


def run_remote(router: str, specs: list[RequestSpec], concurrency: int = 1) -> list[dict]:
    """Requests in file order, at most `concurrency` in flight; sessions keep their order."""
    with grpc.insecure_channel(router) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        if concurrency <= 1:
            return [generate_one(stub, s) for s in specs]
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(lambda s: generate_one(stub, s), specs))
