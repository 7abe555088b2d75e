"""One response's requests: a request per prompt, whose `n` samples are its choices (one
prefill, n decodes), run through the orchestrator (`bridge.Chunks`, a `SampleChunks` a choice
when n > 1), each choice folded into its `Answer` and worded by a `Shape`, whole or as
server-sent events that name their choice's index.

A stop string ends a choice early: its request is stopped on both workers and its summary
awaited (`_settle`). A client that disconnects cancels every choice's request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from baton.agents.parse import OutputParser
from baton.contract import GenerateInput, SamplingParams
from baton.errors import InvalidRequestError
from router.http.answer import Answer, Shape
from router.http.bridge import Chunks, SampleChunks, SampleFailed, watch_disconnect
from router.http.errors import ApiError, baton_error_response, param_of
from router.http.logprobs import LogprobView, token_text
from router.http.schemas import MAX_N, ChatCompletionRequest
from router.http.stops import StopStrings

log = logging.getLogger("baton.http")


def _sampling(body, max_tokens: int, n: int = 1, grammar: str = "") -> SamplingParams:
    """The engine's parameters for a prompt's `n` choices (choice i seeded seed + i)."""
    chat = isinstance(body, ChatCompletionRequest)
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    seed = None if body.seed is None else body.seed % 2**63
    s = SamplingParams(
        n=n,
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
        grammar=grammar,
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


async def generate(ctx, request: Request, body, prompts: list[tuple[list[int], str | None]],
                   limits: list[int], shape_cls: type[Shape], grammar: str = ""):
    """The response to `body`: one choice per prompt and sample, whole or streamed."""
    n = body.n or 1
    if len(prompts) * n > MAX_N:
        raise ApiError(400, f"n: {len(prompts)} prompts x n={n} choices is over the limit of "
                       f"{MAX_N} choices a request", "n")
    tok = ctx.orchestrator.tokenizer
    wants_lp = getattr(body, "logprobs", None) not in (None, False)
    shape = shape_cls(ctx.model_name, body.return_token_ids,
                      LogprobView(token_text(tok)) if wants_lp else None)
    many = len(prompts) > 1
    choices = [c for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True))
               for c in _prompt_choices(ctx, body, shape, i, prompt, limit, many, grammar)]
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


def _prompt_choices(ctx, body, shape: Shape, i: int, prompt: tuple[list[int], str | None],
                    limit: int, many: bool, grammar: str = "") -> list[_Choice]:
    """Prompt i's n choices (indexes i * n ..), its request started (one for all n); `many`:
    the response has several prompts, whose requests are labelled `<response id>-<i>`."""
    ids, text = prompt
    n, tok = body.n or 1, ctx.orchestrator.tokenizer
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    rid = f"{shape.id}-{i}" if many else shape.id
    inp = GenerateInput(rid, tuple(ids), None, _sampling(body, limit, n, grammar), body.session_id or "")
    chunks = Chunks(ctx.orchestrator, inp, ctx.metrics.timer("http"), ctx.pool)
    out = []
    for j in range(n):
        index = i * n + j
        answer = Answer(StopStrings(stops), len(ids), body.session_id or "",
                        tok.decode if tok is not None else None, index=index,
                        counts_prompt=j == 0, hide_output=getattr(body, "max_tokens", 1) == 0)
        if getattr(shape, "spec", None) is not None:
            answer.parser = OutputParser(shape.spec)
        if getattr(body, "echo", False):
            answer.echo_ids = list(ids)
            answer.echo_text = text if text is not None else (
                tok.decode(ids) if tok is not None else "")
        out.append(_Choice(answer, chunks.sample(j) if n > 1 else chunks))
    return out


def _end_all(choices: list[_Choice], watcher: asyncio.Task) -> None:
    watcher.cancel()
    for c in choices:
        _end(c.chunks, c.answer)


async def _fold(chunks: Chunks | SampleChunks, answer: Answer, batch: list) -> None:
    """The choice's whole answer. A sample that fails after its first token (n > 1) ends its
    own choice with finish_reason "error"; its siblings' answers go out all the same."""
    try:
        while batch:
            for c in batch:
                answer.add(c)
            if answer.done:
                break
            batch = await chunks.next_batch()
    except SampleFailed as e:  # one sample's failure: its choice says so
        log.warning("choice %d failed after its first token: %s", answer.index, e)
        answer.finish_reason = "error"
        return
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
            for event in shape.chunks(text, ids, lps, answer, first):
                yield _sse(event)
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
