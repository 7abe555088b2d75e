"""One answer as it streams in, and its OpenAI response shapes (completion or chat).

`Answer` folds GenerateChunks into text, token ids and a finish reason (a stop string ends it
early); `Shape` words it as `text_completion` or `chat.completion` objects, whole or as
stream chunks.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from baton.contract import GenerateChunk, GenerateSummary
from router.http.stops import StopStrings


@dataclass
class Answer:
    stops: StopStrings
    prompt_tokens: int
    session_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    summary: GenerateSummary | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, chunk: GenerateChunk) -> tuple[str, list[int]]:
        """Folds in one chunk; returns the text and token ids it adds to the answer."""
        if self.done:
            return "", []
        self.token_ids.extend(chunk.token_ids)
        text, hit = self.stops.feed(chunk.text)
        if hit:
            self.finish_reason = "stop"
        elif chunk.summary is not None:
            self.summary = chunk.summary
            self.finish_reason = chunk.summary.finish_reason.value
            text += self.stops.flush()
        self.text += text
        return text, list(chunk.token_ids)

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
        if s is not None:  # a stop string cancels the request before its summary
            out.update(prefill_worker=s.prefill_worker, decode_worker=s.decode_worker,
                       retries=s.retries, ttft_ms=round(s.ttft_ms, 3))
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
