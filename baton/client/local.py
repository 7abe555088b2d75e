"""`baton generate --local`: the colocated engine in-process, the reference for the cluster."""

from __future__ import annotations

from collections import deque

from baton.client.requests import RequestSpec, result_dict
from baton.engine.engine import Engine
from baton.engine.request import Request
from baton.errors import BatonError


def run_local(engine: Engine, specs: list[RequestSpec], concurrency: int = 1) -> list[dict]:
    """Submit in order with at most `concurrency` in flight; one result (or error) per spec."""
    pending = deque(specs)
    live: dict[str, dict] = {}
    results: dict[str, dict] = {}
    while pending or live:
        while pending and len(live) < max(1, concurrency):
            spec = pending.popleft()
            try:
                ids = spec.prompt_ids if spec.prompt_ids is not None else engine.tokenizer.encode(spec.prompt)
                engine.add_request(Request(spec.id, list(ids), spec.sampling, spec.session))
            except BatonError as e:
                results[spec.id] = {"id": spec.id, "error": str(e)}
                continue
            live[spec.id] = _acc(spec)
        for out in engine.step():
            acc = live[out.request_id]
            acc["token_ids"].extend(out.new_token_ids)
            if "logprobs" in acc:
                acc["logprobs"].extend(out.logprobs)
            if "prompt_logprobs" in acc and out.prompt_logprobs:
                acc["prompt_logprobs"] = list(out.prompt_logprobs)
            if out.finished:
                acc.update(
                    finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
                    cached_tokens=out.cached_tokens, ttft_ms=out.ttft_ms, latency_ms=out.latency_ms,
                )
                if engine.spec is not None:  # speculative decoding: drafts made, accepted
                    acc.update(draft_tokens=out.draft_tokens, accepted_tokens=out.accepted_tokens)
                del live[out.request_id]
                text = engine.tokenizer.decode(acc["token_ids"]) if engine.tokenizer else ""
                results[out.request_id] = result_dict(out.request_id, acc, text, "local", "local")
    return [results[s.id] for s in specs]


def _acc(spec: RequestSpec) -> dict:
    """What a request's outputs fold into; logprobs only when it asked for them."""
    acc: dict = {"token_ids": []}
    if spec.sampling.logprobs is not None:
        acc["logprobs"] = []
    if spec.sampling.prompt_logprobs is not None:
        acc["prompt_logprobs"] = []
    return acc
