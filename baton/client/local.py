"""`baton generate --local`: the colocated engine in-process, the reference for the cluster."""

from __future__ import annotations

from collections import deque

from baton.client.requests import RequestSpec, result_dict
from baton.engine.engine import Engine
from baton.engine.request import Request
from baton.errors import BatonError


def run_local(engine: Engine, specs: list[RequestSpec], concurrency: int = 1) -> list[dict]:
    """Submit in order with at most `concurrency` in flight; one result (or error) per spec,
    or per sample of a spec with n > 1 (each with its `index`)."""
    pending = deque(specs)
    live: dict[tuple[str, int], dict] = {}
    results: dict[tuple[str, int], dict] = {}
    ns = {s.id: s.sampling.n for s in specs}
    while pending or live:
        while pending and len({rid for rid, _ in live}) < max(1, concurrency):
            spec = pending.popleft()
            try:
                ids = spec.prompt_ids if spec.prompt_ids is not None else engine.tokenizer.encode(spec.prompt)
                engine.add_request(Request(spec.id, list(ids), spec.sampling, spec.session))
            except BatonError as e:
                results[(spec.id, 0)] = {"id": spec.id, "error": str(e)}
                continue
            live.update({(spec.id, i): _acc(spec) for i in range(spec.sampling.n)})
        for out in engine.step():
            key = (out.request_id, out.sample)
            acc = live[key]
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
                del live[key]
                text = engine.tokenizer.decode(acc["token_ids"]) if engine.tokenizer else ""
                results[key] = result_dict(out.request_id, acc, text, "local", "local")
                if ns[out.request_id] > 1:
                    results[key]["index"] = out.sample
    return [results[(s.id, i)] for s in specs for i in range(s.sampling.n)
            if (s.id, i) in results]



def _acc(spec: RequestSpec) -> dict:
    """What a request's outputs fold into; logprobs only when it asked for them."""
    acc: dict = {"token_ids": []}
    if spec.sampling.logprobs is not None:
        acc["logprobs"] = []
    if spec.sampling.prompt_logprobs is not None:
        acc["prompt_logprobs"] = []
    return acc
