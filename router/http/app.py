"""The OpenAI-compatible routes: completions and chat completions (whole or streamed as
server-sent events), /tokenize and /detokenize, models, health and Prometheus metrics.

Life of an HTTP request:
  1. the body is read (at most `router.http_max_body_bytes`) and validated (`schemas.py`);
  2. each prompt is tokenized here (chat: rendered with the checkpoint's template first) and
     its length checked against the model's context;
  3. `generate.py` starts one request per choice (prompt x n); `bridge.Chunks` runs
     `Orchestrator.generate` on a thread for each, the same path as gRPC's Generate;
  4. `answer.Answer` folds a choice's chunks and `answer.Shape` words them (logprobs in
     `logprobs.py`); a stop string ends the answer early: the request is stopped on both
     workers and its summary awaited;
  5. a client that disconnects cancels the requests, which aborts them on both workers.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import re
from concurrent.futures import Executor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from baton.agents.messages import template_messages
from baton.agents.parse import OutputSpec
from baton.contract import Role
from baton.errors import BatonError, InvalidRequestError
from baton.model.chat_template import ChatTemplate
from router.http import responses as responses_api
from router.http import tokens
from router.http.answer import ChatShape, CompletionShape
from router.http.constraints import chat_grammar
from router.http.errors import (
    ApiError,
    api_error_response,
    baton_error_response,
    error_body,
    from_validation,
)
from router.http.generate import generate
from router.http.schemas import MAX_N, ChatCompletionRequest, CompletionRequest
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator

log = logging.getLogger("baton.http")
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
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
    weights: dict | None = None
    """`weight_format` and `checkpoint_bytes` of the served checkpoint (/v1/models)."""
    responses: responses_api.Store = field(default_factory=responses_api.Store)
    """Stored responses of /v1/responses (`store`), for `previous_response_id`."""


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
        return await generate(ctx, request, body, prompts, limits, CompletionShape)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest, ctx)
        prompt, spec, grammar, _ = await _off_loop(ctx, _chat_prompt, ctx, body)
        limit = _fit(ctx, len(prompt), body.limit, "messages")
        shape = functools.partial(ChatShape, spec=spec)
        return await generate(ctx, request, body, [(prompt, "")], [limit], shape, grammar)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await _responses(ctx, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        found = ctx.responses.get(response_id)
        if found is None:
            raise ApiError(404, f"No response found with id '{response_id}' (only stored "
                           "responses are kept: store true)", "response_id", "not_found")
        return found[0]

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokens.tokenize(ctx, await _read_body(request, ctx.max_body_bytes))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokens.detokenize(ctx, await _read_body(request, ctx.max_body_bytes))

    @app.get("/v1/models")
    async def models():
        card = {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "baton",
                "max_model_len": ctx.max_model_len, **(ctx.weights or {})}
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


async def _responses(ctx: HttpContext, request: Request):
    """POST /v1/responses: the request as a chat request, its answer as output items
    (router/http/responses.py)."""
    R = responses_api
    body = await _parse_body(request, R.ResponsesRequest, ctx)
    refused = body.unsupported()
    if refused:
        name, why = refused[0]
        raise ApiError(400, f"{name}: {why}", name, "unsupported_parameter")
    history, session = [], ""
    if body.previous_response_id:
        found = ctx.responses.get(body.previous_response_id)
        if found is None:
            raise ApiError(400, f"previous_response_id: no stored response "
                           f"'{body.previous_response_id}' (store it with store: true; the "
                           f"newest {R.MAX_STORED} are kept)", "previous_response_id",
                           "previous_response_not_found")
        _, history, session, before = found
    else:
        before = None
    rid, created = R.new_id("resp"), R.now()
    session = session or rid
    chat = R.chat_body(body, history, session)
    creq = R.to_chat_request(chat)
    refused = creq.unsupported()
    if refused:
        name, why = refused[0]
        raise ApiError(400, f"{name}: {why}", name, "unsupported_parameter")
    prompt, spec, grammar, text = await _off_loop(ctx, _chat_prompt, ctx, creq)
    if before is not None:  # the conversation's own tokens so far, then the new turn's
        prompt = R.spliced(ctx.orchestrator.tokenizer, before, text, prompt)
    limit = _fit(ctx, len(prompt), creq.limit, "input")
    shape = functools.partial(ChatShape, spec=spec)
    answer = await generate(ctx, request, creq, [(prompt, "")], [limit], shape, grammar)
    turns = [*history, *R.input_messages(body.input)]

    def keep(response: dict, message: dict, output_ids: list[int]) -> None:
        if body.store is not False:
            ctx.responses.put(response, [*turns, R.answer_message(message)], session,
                              R.Turn(text, tuple(prompt), tuple(output_ids)))

    if not body.stream:
        data = json.loads(answer.body)
        choice = data["choices"][0]
        out = R.response_object(rid, body, R.output_items(choice["message"]), data["usage"],
                                choice["finish_reason"], created)
        keep(out, choice["message"], choice.get("token_ids", []))
        return JSONResponse(out)

    async def events():
        tr = R.StreamTranslator(rid, body, created)
        output_ids: list[int] = []
        for e in tr.start():
            yield _event(e)
        async for raw in answer.body_iterator:
            for part in raw.split("\n\n"):
                if not part.startswith("data: ") or part == "data: [DONE]":
                    continue
                chunk = json.loads(part[6:])
                if "error" in chunk:
                    yield _event({"type": "error", "sequence_number": tr.seq,
                                  "message": chunk["error"].get("message", ""),
                                  "code": chunk["error"].get("code"), "param": None})
                    return
                for c in chunk.get("choices", []):
                    output_ids.extend(c.get("token_ids") or [])
                for e in tr.chunk(chunk):
                    yield _event(e)
        tail, response = tr.end()
        for e in tail:
            yield _event(e)
        keep(response, tr.message, output_ids)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _event(e: dict) -> str:
    return f"event: {e['type']}\ndata: {json.dumps(e, separators=(',', ':'))}\n\n"


def _key_presented(header: str, keys: frozenset[str]) -> bool:
    given = header[len("Bearer "):].encode() if header.startswith("Bearer ") else b""
    return any([hmac.compare_digest(given, k.encode()) for k in keys])


async def _off_loop(ctx: HttpContext, fn, *args):
    """Runs `fn` on a request thread: templating and tokenizing a long prompt would otherwise
    stall every stream this event loop serves."""
    return await asyncio.get_running_loop().run_in_executor(ctx.pool, fn, *args)


async def _parse_body(request: Request, cls, ctx: HttpContext):
    raw = await _read_body(request, ctx.max_body_bytes)
    try:
        body = cls.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation(e) from None
    if body.model != ctx.model_name:
        raise ApiError(404, f"The model '{body.model}' does not exist; this server serves "
                       f"'{ctx.model_name}' (GET /v1/models)", "model", "model_not_found")
    return body


async def _parse(request: Request, cls, ctx: HttpContext):
    body = await _parse_body(request, cls, ctx)
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


def _chat_prompt(ctx: HttpContext, body: ChatCompletionRequest
                 ) -> tuple[list[int], OutputSpec | None, str, str]:
    """The prompt's token ids, how its answers are read (reasoning, tool calls), the grammar
    they follow ("" = none) and the rendered prompt text."""
    if ctx.chat_template is None:
        raise ApiError(400, "messages: this model has no chat template (tokenizer_config.json "
                       "chat_template); use /v1/completions", "messages")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
    if tools and not ctx.chat_template.supports_tools:
        raise ApiError(400, "tools: this model's chat template has no tool support (it never "
                       "reads `tools`); leave tools out or serve a checkpoint whose template "
                       "renders them", "tools")
    try:  # content parts: their texts joined (schemas.py)
        messages = template_messages([m.for_template() for m in body.messages])
        text = ctx.chat_template.render(messages, tools=tools,
                                        **(body.chat_template_kwargs or {}))
    except InvalidRequestError as e:
        raise ApiError(400, str(e), _field(str(e))) from None
    ids = _encode(ctx, text)
    if not ids:
        raise ApiError(400, "messages: the rendered prompt is empty", "messages")
    spec = OutputSpec(ctx.chat_template.call_format,
                      tools if body.tool_choice != "none" else None,
                      reasoning=text.rstrip(" \n").endswith("<think>"),
                      parallel=body.parallel_tool_calls is not False)
    try:
        grammar, tc, rf = chat_grammar(body, spec.call_format, spec.tools, spec.reasoning)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), _field(str(e))) from None
    ctx.metrics.count_constraint(tc, rf)
    return ids, (spec if spec.tools or spec.reasoning else None), grammar, text


def _field(message: str) -> str:
    """The field an error message starts with (`messages[2].tool_calls[0]...: why`)."""
    m = re.match(r"([A-Za-z_][\w\[\].]*):", message)
    return m.group(1) if m else "messages"


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
