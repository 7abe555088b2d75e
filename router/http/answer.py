"""One answer as it streams in, and its OpenAI response shapes (completion or chat).

`Answer` folds GenerateChunks into text, token ids and a finish reason. A stop string ends it
early: the text before the stop string, the tokens through the one that completed it, and the
summary that the stopped request still ends with. `Shape` words it as `text_completion` or
`chat.completion` objects, whole or as stream chunks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from baton.contract import GenerateChunk, GenerateSummary
from router.http.stops import StopStrings


@dataclass
class Answer:
    stops: StopStrings
    prompt_tokens: int
    session_id: str = ""
    decode: Callable[[Sequence[int]], str] | None = None
    """The router tokenizer's decode: finds the token that completed a stop string inside a
    chunk of several (None: the whole chunk counts)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    summary: GenerateSummary | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def complete(self) -> bool:
        """Done, with the request's summary: a stop string ends the answer before it comes."""
        return self.done and self.summary is not None

    def add(self, chunk: GenerateChunk) -> tuple[str, list[int]]:
        """Folds in one chunk; returns the text and token ids it adds to the answer. After a stop
        string only the summary is taken (the request ends with it, the tokens are past the
        answer)."""
        if chunk.summary is not None:
            self.summary = chunk.summary
        if self.done:
            return "", []
        ids = list(chunk.token_ids)
        text, hit = self.stops.feed(chunk.text)
        if hit:
            self.finish_reason = "stop"
            ids = ids[: self._through_stop(ids)]
        elif chunk.summary is not None:
            self.finish_reason = chunk.summary.finish_reason.value
            text += self.stops.flush()
        self.text += text
        self.token_ids.extend(ids)
        return text, ids

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

    def usage(self) -> dict:
        n = len(self.token_ids)
        cached = self.summary.cached_tokens if self.summary else 0
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": cached}}

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


class Shape:
    """The envelope shared by both APIs; subclasses word the choice."""

    object = chunk_object = prefix = ""

    def __init__(self, model: str, return_token_ids: bool):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.return_token_ids = return_token_ids

    def whole(self, a: Answer) -> dict:
        choice = self.choice(a.text, a.finish_reason)
        if self.return_token_ids:
            choice["token_ids"] = a.token_ids
        return {**self._head(self.object), "choices": [choice], "usage": a.usage(),
                "baton": a.baton()}

    def chunk(self, text: str, token_ids: list[int], a: Answer, first: bool) -> dict:
        choice = self.delta(text, a.finish_reason, first)
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        out = {**self._head(self.chunk_object), "choices": [choice]}
        if a.done:
            out["baton"] = a.baton()
        return out

    def usage_chunk(self, a: Answer) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": a.usage()}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str, finish: str | None) -> dict:
        raise NotImplementedError

    def delta(self, text: str, finish: str | None, first: bool) -> dict:
        raise NotImplementedError


class CompletionShape(Shape):
    object = chunk_object = "text_completion"
    prefix = "cmpl"

    def choice(self, text, finish):
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def delta(self, text, finish, first):
        return self.choice(text, finish)


class ChatShape(Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prefix = "chatcmpl"

    def choice(self, text, finish):
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish}

    def delta(self, text, finish, first):
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
