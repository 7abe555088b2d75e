"""Request bodies of the OpenAI-compatible API, as OpenAI defines them, plus Baton's extras.

Unknown fields are refused (OpenAI answers "Unrecognized request argument supplied"). Fields
OpenAI has and Baton does not implement are accepted only at their neutral value and refused by
name otherwise (`unsupported()`), so a client never gets a silently different answer.

Baton's extras, also accepted by vLLM under the same names: `session_id` (routes a chat's turns
to the worker holding its prefix), `top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Temperature = Field(None, ge=0, le=2, allow_inf_nan=False)
TopP = Field(None, gt=0, le=1, allow_inf_nan=False)
Penalty = Field(None, ge=-2, le=2, allow_inf_nan=False)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    temperature: float | None = Temperature
    """None = OpenAI's default, 1.0."""
    top_p: float | None = TopP
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = Penalty
    frequency_penalty: float | None = Penalty
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Baton's extras (vLLM's names)
    session_id: str | None = None
    top_k: int | None = Field(None, ge=0, lt=2**31)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each field set to a value Baton does not implement."""
        out = []
        if self.n not in (None, 1):
            out.append(("n", "only n=1 is supported; send one request per completion"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                out.append((name, "penalties are not supported; leave it out or send 0"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported; leave it out"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options needs stream: true"))
        return out


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs is not None:
            out.append(("logprobs", "logprobs are not supported; leave the field out"))
        if self.echo:
            out.append(("echo", "echo is not supported; leave it out or send false"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "only best_of=1 is supported"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        return out


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for max_tokens; None = up to the model's context length."""
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs or self.top_logprobs is not None:
            out.append(("logprobs", "logprobs are not supported; leave the field out"))
        if self.tools or self.tool_choice not in (None, "none"):
            out.append(("tools", "tool calling is not supported; leave tools out"))
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            out.append(("max_tokens", "send max_tokens or max_completion_tokens, not both"))
        return out

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
