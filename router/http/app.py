"""The OpenAI-compatible routes: completions and chat completions (whole or streamed as
server-sent events), models, health and Prometheus metrics.

Life of an HTTP request:
  1. the body is read (at most `router.http_max_body_bytes`) and validated (`schemas.py`);
  2. the prompt is tokenized here (chat: rendered with the checkpoint's template first) and its
     length checked against the model's context;
  3. `bridge.Chunks` runs `Orchestrator.generate` on a thread, the same path as gRPC's Generate;
  4. `answer.Answer` folds the chunks and `answer.Shape` words them; a stop string ends the
     answer early: the request is stopped on both workers and its summary awaited (`_settle`);
  5. a client that disconnects cancels the request, which aborts it on both workers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from concurrent.futures import Executor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from baton.contract import GenerateInput, Role, SamplingParams
from baton.errors import BatonError, InvalidRequestError
from baton.model.chat_template import ChatTemplate
from router.http import tokens
from router.http.answer import Answer, ChatShape, CompletionShape, Shape
from router.http.bridge import Chunks, watch_disconnect
from router.http.errors import (
    ApiError,
    api_error_response,
    baton_error_response,
    error_body,
    from_validation,
    param_of,
)
from router.http.logprobs import LogprobView, token_text
from router.http.schemas import MAX_N, ChatCompletionRequest, CompletionRequest
from router.http.stops import StopStrings
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator

log = logging.getLogger("baton.http")
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
OUTCOME_OF_HTTP = {400: "invalid", 404: "invalid", 413: "invalid", 429: "capacity",
                   499: "cancelled", 503: "unavailable"}
DRAIN_FACTOR = 16
"""A body declared this many times over the limit is refused before it is read (the connection
then closes); smaller excess is read and dropped, so the client gets its 413 cleanly."""


@dataclass
class HttpContext:
    orchestrator: Orchestrator
    metrics: RouterMetrics
    model_name: str
    """What clients send as `model` (and /v1/models lists)."""
    chat_template: ChatTemplate | None
    max_model_len: int
    """Prompt + output tokens the workers accept; bounds prompts and the default max_tokens."""
    max_body_bytes: int
    pool: Executor
    """Threads that run requests (one each while it streams)."""
    api_keys: frozenset[str] = frozenset()
    """Bearer keys the /v1 API needs (`router.api_keys_file`, `BATON_API_KEY`); empty: open."""


def make_app(ctx: HttpContext) -> FastAPI:
    app = FastAPI(title="Baton", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def _api_key(request: Request, call_next):
        # /health and /metrics stay open for probes and scrapers, as gRPC health does
        if ctx.api_keys and request.url.path.startswith("/v1/") and \
                not _key_presented(request.headers.get("authorization", ""), ctx.api_keys):
            body = error_body(401, "this API needs a key: send `Authorization: Bearer <key>` "
                                   "(router.api_keys_file or BATON_API_KEY)", code="invalid_api_key")
            return JSONResponse(body, status_code=401)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        if request.url.path in GENERATE_PATHS:
            ctx.metrics.requests.labels("http", OUTCOME_OF_HTTP.get(e.status, "error")).inc()
        return api_error_response(e)

    @app.exception_handler(BatonError)
    async def _baton_error(request: Request, e: BatonError):
        return baton_error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):  # starlette logs the traceback
        return baton_error_response(e)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest, ctx)
        prompts = await _off_loop(ctx, _completion_prompts, ctx, body.prompt)
        limits = [_fit(ctx, len(p), max(1, body.max_tokens), "prompt") for p, _ in prompts]
        return await _generate(ctx, request, body, prompts, limits, CompletionShape)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest, ctx)
        prompt = await _off_loop(ctx, _chat_prompt, ctx, body)
        limit = _fit(ctx, len(prompt), body.limit, "messages")
        return await _generate(ctx, request, body, [(prompt, "")], [limit], ChatShape)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokens.tokenize(ctx, await _read_body(request, ctx.max_body_bytes))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokens.detokenize(ctx, await _read_body(request, ctx.max_body_bytes))

    @app.get("/v1/models")
    async def models():
        card = {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "baton",
                "max_model_len": ctx.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        reg = ctx.orchestrator.registry
        counts = {f"{r.value}_workers": len(reg.workers(r)) for r in Role}
        ready = all(counts.values())
        body = {"status": "ready" if ready else "not ready", **counts}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _key_presented(header: str, keys: frozenset[str]) -> bool:
    given = header[len("Bearer "):].encode() if header.startswith("Bearer ") else b""
    return any([hmac.compare_digest(given, k.encode()) for k in keys])


async def _off_loop(ctx: HttpContext, fn, *args):
    """Runs `fn` on a request thread: templating and tokenizing a long prompt would otherwise
    stall every stream this event loop serves."""
    return await asyncio.get_running_loop().run_in_executor(ctx.pool, fn, *args)


async def _parse(request: Request, cls, ctx: HttpContext):
    raw = await _read_body(request, ctx.max_body_bytes)
    try:
        body = cls.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation(e) from None
    if body.model != ctx.model_name:
        raise ApiError(404, f"The model '{body.model}' does not exist; this server serves "
                       f"'{ctx.model_name}' (GET /v1/models)", "model", "model_not_found")
    refused = body.unsupported()
    if refused:
        name, why = refused[0]
        raise ApiError(400, f"{name}: {why}", name, "unsupported_parameter")
    return body


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    too_big = f"the request body is over the limit of {limit} bytes (router.http_max_body_bytes)"
    if declared.isdigit() and int(declared) > limit * DRAIN_FACTOR:
        raise ApiError(413, too_big, code="body_too_large")
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size <= limit:
                parts.append(part)
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected while sending the body") from None
    if size > limit:
        raise ApiError(413, too_big, code="body_too_large")
    return b"".join(parts)


def _completion_prompts(ctx: HttpContext, prompt) -> list[tuple[list[int], str]]:
    """(token ids, text) of each prompt of the request (a string, ids, or a list of either)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty: send a non-empty prompt", "prompt")
    if len(prompt) > MAX_N:
        raise ApiError(400, f"prompt: a batch of {len(prompt)} prompts is over the limit of "
                       f"{MAX_N}; split it", "prompt")
    out = []
    for p in prompt:
        ids = _encode(ctx, p) if isinstance(p, str) else list(p)
        if not ids:
            raise ApiError(400, "prompt is empty: send a non-empty prompt", "prompt")
        bad = [t for t in ids if not 0 <= t < 2**31]
        if bad:
            raise ApiError(400, f"prompt: token ids must be in [0, 2^31), got {bad[:5]}",
                           "prompt")
        out.append((ids, p if isinstance(p, str) else None))
    return out


def _chat_prompt(ctx: HttpContext, body: ChatCompletionRequest) -> list[int]:
    if ctx.chat_template is None:
        raise ApiError(400, "messages: this model has no chat template (tokenizer_config.json "
                       "chat_template); use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in body.messages]  # content parts: their texts joined (schemas.py)
    ids = _encode(ctx, ctx.chat_template.render(messages))
    if not ids:
        raise ApiError(400, "messages: the rendered prompt is empty", "messages")
    return ids


def _encode(ctx: HttpContext, text: str) -> list[int]:
    tok = ctx.orchestrator.tokenizer
    if tok is None:
        raise ApiError(400, "prompt: this router has no tokenizer; send token ids", "prompt")
    return list(tok.encode(text))


def _fit(ctx: HttpContext, prompt_len: int, max_tokens: int | None, param: str) -> int:
    """max_tokens, checked against the context (None: all the context the prompt leaves)."""
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise ApiError(400, f"{param}: the prompt has {prompt_len} tokens but the model's "
                       f"context length is {limit} (prompt + at least one output token); "
                       f"shorten the prompt", param, "context_length_exceeded")
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise ApiError(400, f"max_tokens: {prompt_len} prompt tokens + {max_tokens} output "
                       f"tokens exceed the model's context length of {limit}; lower max_tokens",
                       "max_tokens", "context_length_exceeded")
    return max_tokens


def _sampling(body, max_tokens: int, sample: int) -> SamplingParams:
    """The engine's parameters for choice `sample` of a prompt (seeded: seed + sample)."""
    chat = isinstance(body, ChatCompletionRequest)
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    seed = None if body.seed is None else (body.seed + sample) % 2**63
    s = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0, seed=seed,
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items())),
        min_tokens=min(body.min_tokens, max_tokens),
    )
    try:
        s.validate()  # the workers check token ids against their vocabulary
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param_of(str(e))) from None
    return s


@dataclass
class _Choice:
    """One answer of the response, and the request that computes it."""

    answer: Answer
    chunks: Chunks


class _All:
    """Cancels every choice's request (a client that disconnects)."""

    def __init__(self, choices: list[_Choice]):
        self.choices = choices

    def cancel(self) -> None:
        for c in self.choices:
            c.chunks.cancel.cancel()


async def _generate(ctx: HttpContext, request: Request, body, prompts: list[tuple[list[int], str]],
                    limits: list[int], shape_cls: type[Shape]):
    n = body.n or 1
    if len(prompts) * n > MAX_N:
        raise ApiError(400, f"n: {len(prompts)} prompts x n={n} choices is over the limit of "
                       f"{MAX_N} choices a request", "n")
    tok = ctx.orchestrator.tokenizer
    wants_lp = getattr(body, "logprobs", None) not in (None, False)
    shape = shape_cls(ctx.model_name, body.return_token_ids,
                      LogprobView(token_text(tok)) if wants_lp else None)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    echo = bool(getattr(body, "echo", False))
    choices: list[_Choice] = []
    for i, ((prompt, text), limit) in enumerate(zip(prompts, limits, strict=True)):
        sampling = [_sampling(body, limit, j) for j in range(n)]
        for j in range(n):
            index = i * n + j
            rid = shape.id if len(prompts) * n == 1 else f"{shape.id}-{index}"
            inp = GenerateInput(rid, tuple(prompt), None, sampling[j], body.session_id or "")
            answer = Answer(StopStrings(stops), len(prompt), body.session_id or "",
                            tok.decode if tok is not None else None, index=index,
                            counts_prompt=j == 0, hide_output=getattr(body, "max_tokens", 1) == 0)
            if echo:
                answer.echo_ids = list(prompt)
                answer.echo_text = text if text is not None else (
                    tok.decode(prompt) if tok is not None else "")
            choices.append(_Choice(answer, Chunks(ctx.orchestrator, inp,
                                                  ctx.metrics.timer("http"), ctx.pool)))
    watcher = asyncio.create_task(watch_disconnect(request, _All(choices)))
    # errors before the first token keep their status
    firsts = await asyncio.gather(*(c.chunks.next_batch() for c in choices),
                                  return_exceptions=True)
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        _end_all(choices, watcher)
        raise failed[0]
    if not body.stream:
        try:
            await asyncio.gather(*(_fold(c.chunks, c.answer, f)
                                   for c, f in zip(choices, firsts, strict=True)))
        finally:
            _end_all(choices, watcher)
        return JSONResponse(shape.whole([c.answer for c in choices]))
    usage = bool(body.stream_options and body.stream_options.include_usage)
    events = _merged(choices, watcher, shape, firsts, usage)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _end_all(choices: list[_Choice], watcher: asyncio.Task) -> None:
    watcher.cancel()
    for c in choices:
        _end(c.chunks, c.answer)


async def _fold(chunks: Chunks, answer: Answer, batch: list) -> None:
    while batch:
        for c in batch:
            answer.add(c)
        if answer.done:
            break
        batch = await chunks.next_batch()
    await _settle(chunks, answer)


async def _settle(chunks: Chunks, answer: Answer) -> None:
    """When a stop string ended the answer before the request's summary: stops the request
    (both workers are cancelled) and waits for the summary, which follows at once, so the
    answer reports its cached tokens and workers like one ended by max_tokens. An error
    meanwhile ends the wait: the answer is whole, only without its summary."""
    if not answer.done or answer.complete:
        return
    chunks.stop()
    try:
        while not answer.complete:
            batch = await chunks.next_batch()
            if not batch:
                return
            for c in batch:
                answer.add(c)
    except Exception as e:  # noqa: BLE001 - the answer is whole: it goes out without summary
        log.warning("a request ended by a stop string failed before its summary: %s", e)


async def _merged(choices: list[_Choice], watcher, shape: Shape, firsts: list, usage: bool):
    """Every choice's events as they come (each names its index), then usage and [DONE]."""
    try:
        if len(choices) == 1:
            async for event in _events(choices[0], shape, firsts[0]):
                yield event
        else:
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(c, first):
                try:
                    async for event in _events(c, shape, first):
                        await queue.put(event)
                finally:
                    await queue.put(None)

            tasks = [asyncio.create_task(pump(c, f)) for c, f in zip(choices, firsts,
                                                                     strict=True)]
            try:
                for _ in tasks:
                    while (event := await queue.get()) is not None:
                        yield event
            finally:
                for t in tasks:
                    t.cancel()
        if usage:
            yield _sse(shape.usage_chunk([c.answer for c in choices]))
    finally:
        _end_all(choices, watcher)
    yield "data: [DONE]\n\n"


async def _events(c: _Choice, shape: Shape, batch: list):
    """One choice's events; an error after the first token ends its stream with an error."""
    chunks, answer = c.chunks, c.answer
    first = True
    try:
        while batch:
            text, ids, lps = "", [], []
            for chunk in batch:
                t, i, lp = answer.add(chunk)
                text, ids, lps = text + t, ids + i, lps + lp
            await _settle(chunks, answer)  # the last event carries the summary's fields
            yield _sse(shape.chunk(text, ids, lps, answer, first))
            first = False
            if answer.done:
                break
            batch = await chunks.next_batch()
    except Exception as e:  # noqa: BLE001 - the status is sent: the error goes in the stream
        yield _sse(json.loads(baton_error_response(e).body))


def _end(chunks: Chunks, answer: Answer) -> None:
    stopped_early = answer.finish_reason == "stop" and answer.summary is None
    chunks.close("stop" if stopped_early else None)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
