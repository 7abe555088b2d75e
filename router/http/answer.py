"""One answer as it streams in, and its OpenAI response shapes (completion or chat).

`Answer` folds GenerateChunks into text, token ids, their logprobs and a finish reason. A stop
string ends it early: the text before the stop string, the tokens through the one that completed
it, and the summary that the stopped request still ends with. `Shape` words one or several
answers (a list of prompts, `n`) as `text_completion` or `chat.completion` objects, whole or as
stream chunks, with OpenAI's logprobs objects (`logprobs.py`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from baton.agents.parse import OutputParser, OutputSpec
from baton.contract import GenerateChunk, GenerateSummary, TokenLogprob
from router.http.logprobs import LogprobView
from router.http.stops import StopStrings


@dataclass
class Answer:
    stops: StopStrings
    prompt_tokens: int
    session_id: str = ""
    decode: Callable[[Sequence[int]], str] | None = None
    """The router tokenizer's decode: finds the token that completed a stop string inside a
    chunk of several (None: the whole chunk counts)."""
    index: int = 0
    """The choice's place in the response (prompt i, sample j: i * n + j)."""
    counts_prompt: bool = True
    """False for samples 1.. of a prompt: usage counts each prompt once."""
    hide_output: bool = False
    """max_tokens 0 (echo): the one token drawn is not part of the answer."""
    echo_ids: list[int] | None = None
    """echo: the prompt's ids (its text is `echo_text`), put before the answer."""
    echo_text: str = ""
    parser: OutputParser | None = None
    """Chat answers with tools or reasoning: reads the streamed text (baton/agents/parse.py)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    summary: GenerateSummary | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    text_offset: int = 0
    """Where the next token's text starts in the choice's text (completions logprobs)."""
    _held: tuple[tuple[int, ...], tuple[TokenLogprob, ...]] = field(default=((), ()), init=False)
    """Tokens that came with no text: the worker holds their text back (a character cut in
    two, or no text yet), so they wait for it here. A stop string completed by that text may
    end the answer before them, and tokens already sent cannot be taken back."""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def complete(self) -> bool:
        """Done, with the request's summary: a stop string ends the answer before it comes."""
        return self.done and self.summary is not None

    def add(self, chunk: GenerateChunk) -> tuple[str, list[int], list[TokenLogprob]]:
        """Folds in one chunk; returns the text, token ids and logprobs it adds to the answer.
        After a stop string only the summary is taken (the request ends with it, the tokens are
        past the answer)."""
        if chunk.summary is not None:
            self.summary = chunk.summary
        if chunk.prompt_logprobs:
            self.prompt_logprobs = chunk.prompt_logprobs
        if self.done:
            return "", [], []
        if self.hide_output:
            if chunk.summary is not None:
                self.finish_reason = "length"
            return "", [], []
        ids, lps = [*self._held[0], *chunk.token_ids], [*self._held[1], *chunk.logprobs]
        if not chunk.text and chunk.summary is None:
            self._held = (tuple(ids), tuple(lps))
            return "", [], []
        self._held = ((), ())
        text, hit = self.stops.feed(chunk.text)
        if hit:
            self.finish_reason = "stop"
            ids = ids[: self._through_stop(ids)]
            lps = lps[: len(ids)]
        elif chunk.summary is not None:
            self.finish_reason = chunk.summary.finish_reason.value
            text += self.stops.flush()
        self.text += text
        self.token_ids.extend(ids)
        self.logprobs.extend(lps)
        return text, ids, lps

    def _through_stop(self, ids: list[int]) -> int:
        """How many of a chunk's tokens the answer keeps when a stop string ended it there: up
        to the token that completed the stop string, as if generation had stopped at it."""
        if len(ids) <= 1 or self.decode is None:
            return len(ids)
        want = self.text + self.stops.through_stop  # the chunks' text, up to the stop's end
        lo, hi = 1, len(ids)  # the first k whose text covers `want`; len(ids) always counts
        while lo < hi:
            mid = (lo + hi) // 2
            if self.decode(self.token_ids + ids[:mid]).startswith(want):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def baton(self) -> dict:
        """Baton's own fields: the prefix-cache hit and who served the request."""
        s = self.summary
        out = {"session_id": self.session_id or None,
               "cached_tokens": s.cached_tokens if s else 0}
        if s is not None:  # None only when the request failed after a stop string ended it
            out.update(prefill_worker=s.prefill_worker, decode_worker=s.decode_worker,
                       retries=s.retries, ttft_ms=round(s.ttft_ms, 3))
            if s.draft_tokens:  # speculative decoding on the decode worker
                out.update(draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens)
        return out


def usage(answers: Sequence[Answer]) -> dict:
    """Every choice's tokens; each prompt counted once (its first sample)."""
    first = [a for a in answers if a.counts_prompt]
    prompt = sum(a.prompt_tokens for a in first)
    n = sum(len(a.token_ids) for a in answers)
    cached = sum(a.summary.cached_tokens for a in first if a.summary)
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Shape:
    """The envelope shared by both APIs; subclasses word the choice."""

    object = chunk_object = prefix = ""

    def __init__(self, model: str, return_token_ids: bool, view: LogprobView | None = None):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids
        self.view = view
        """How the answer's logprobs are worded; None: the request asked for none."""

    def whole(self, answers: Sequence[Answer]) -> dict:
        choices = []
        for a in answers:
            choice = self.choice(a, a.text, a.token_ids, a.logprobs, True)
            if self.return_token_ids:
                choice["token_ids"] = a.token_ids
            choices.append(choice)
        return {**self._head(self.object), "choices": choices, "usage": usage(answers),
                "baton": answers[0].baton()}

    def chunk(self, text: str, token_ids: list[int], lps: list[TokenLogprob], a: Answer,
              first: bool) -> dict:
        choice = self.delta(a, text, token_ids, lps, first)
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        out = {**self._head(self.chunk_object), "choices": [choice]}
        if a.done:
            out["baton"] = a.baton()
        return out

    def chunks(self, text: str, token_ids: list[int], lps: list[TokenLogprob], a: Answer,
               first: bool) -> list[dict]:
        """The stream events of one step: its chunk."""
        return [self.chunk(text, token_ids, lps, a, first)]

    def usage_chunk(self, answers: Sequence[Answer]) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": usage(answers)}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, a: Answer, text: str, ids: list[int], lps: list[TokenLogprob],
               first: bool) -> dict:
        raise NotImplementedError

    def delta(self, a: Answer, text: str, ids: list[int], lps: list[TokenLogprob],
              first: bool) -> dict:
        raise NotImplementedError


class CompletionShape(Shape):
    object = chunk_object = "text_completion"
    prefix = "cmpl"

    def choice(self, a, text, ids, lps, first):
        lp = None
        if first and a.echo_ids is not None:  # the prompt goes first, its token 0 unscored
            text = a.echo_text + text
            if self.view is not None:
                scored = [None, *a.prompt_logprobs][: len(a.echo_ids)]
                scored += [None] * (len(a.echo_ids) - len(scored))
                lp = self.view.completion(a.echo_ids, scored, a)
        if self.view is not None:
            gen = self.view.completion(ids, lps, a)
            lp = gen if lp is None else {k: lp[k] + gen[k] for k in lp}
        return {"index": a.index, "text": text, "logprobs": lp, "finish_reason": a.finish_reason}

    def delta(self, a, text, ids, lps, first):
        return self.choice(a, text, ids, lps, first)


class ChatShape(Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prefix = "chatcmpl"

    def __init__(self, model: str, return_token_ids: bool, view: LogprobView | None = None,
                 spec: OutputSpec | None = None):
        super().__init__(model, return_token_ids, view)
        self.spec = spec
        """How answers are read into reasoning, content and tool calls; None: all content."""

    def choice(self, a, text, ids, lps, first):
        message = {"role": "assistant", "content": text}
        finish = a.finish_reason
        if self.spec is not None:
            parser = OutputParser(self.spec)
            parser.feed(text, final=True)
            message.update(parser.message())
            finish = _finish(finish, "tool_calls" in message)
        return {"index": a.index, "message": message,
                "logprobs": self._logprobs(ids, lps), "finish_reason": finish}

    def delta(self, a, text, ids, lps, first):
        finish = a.finish_reason
        if a.parser is None:
            delta = {"content": text}
        else:
            delta = a.parser.feed(text, final=a.done)
            if first and not delta:
                delta = {"content": ""}
            if a.done:
                finish = _finish(finish, bool(a.parser.parse(final=True).calls))
        if first:
            delta = {"role": "assistant", **delta}
        return {"index": a.index, "delta": delta, "logprobs": self._logprobs(ids, lps),
                "finish_reason": finish}

    def chunks(self, text, token_ids, lps, a, first):
        """A last step that adds tool calls or content ends with a chunk of its own that
        carries the finish_reason alone, as OpenAI streams it (the openai client closes a
        call's arguments on the chunk after them)."""
        out = self.chunk(text, token_ids, lps, a, first)
        choice = out["choices"][0]
        if a.parser is None or choice["finish_reason"] is None or \
                not (set(choice["delta"]) - {"role"}):
            return [out]
        end = {**out, "choices": [{"index": a.index, "delta": {}, "logprobs": None,
                                   "finish_reason": choice["finish_reason"]}]}
        choice["finish_reason"] = None
        out.pop("baton", None)
        return [out, end]

    def _logprobs(self, ids, lps):
        return None if self.view is None else {"content": self.view.chat(ids, lps)}


def _finish(reason: str | None, calls: bool) -> str | None:
    """OpenAI's finish_reason "tool_calls": the model stopped after calling."""
    return "tool_calls" if calls and reason == "stop" else reason
