"""Request bodies of the OpenAI-compatible API, as OpenAI defines them, plus Baton's extras.

Unknown fields are refused (OpenAI answers "Unrecognized request argument supplied"). Fields
OpenAI has and Baton does not implement are accepted only at their neutral value and refused by
name otherwise (`unsupported()`), so a client never gets a silently different answer.

Baton's extras, also accepted by vLLM under the same names: `session_id` (routes a chat's turns
to the worker holding its prefix), `top_k`, `ignore_eos`, `stop_token_ids`, `return_token_ids`,
`repetition_penalty`, `min_tokens`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from baton.sampling import MAX_LOGPROBS

MAX_N = 16
"""Most choices one request may ask for (`n`, or prompts x n): each holds a decode slot."""
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
    n: int | None = Field(None, ge=1, le=MAX_N)
    """Choices per prompt; choice i of a seeded request draws with seed + i."""
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
    repetition_penalty: float | None = Field(None, gt=0, le=100, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0, lt=2**31)

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each field set to a value Baton does not implement."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) >= 2**31:
                out.append(("logit_bias", f"keys are token ids (decimal strings), got {key!r}"))
            elif not -100 <= bias <= 100:
                out.append(("logit_bias", f"values must be in [-100, 100], got {bias!r}"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options needs stream: true"))
        return out


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    """0 only with echo: the prompt's logprobs alone (lm-eval's loglikelihood)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.max_tokens == 0 and not self.echo:
            out.append(("max_tokens", "max_tokens must be >= 1 (0 only with echo: true)"))
        if self.best_of not in (None, self.n or 1):
            out.append(("best_of", f"best_of must equal n ({self.n or 1}): every sample is "
                                   "returned, none is picked on the server"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        return out


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are read (`non_text`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    arguments: str | dict | None = None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    """vLLM's newer name for reasoning_content; either reaches the template."""
    refusal: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as baton/agents/messages.py reads it (content parts joined)."""
        out = self.model_dump(exclude_none=True)
        out["content"] = self.text()
        return out

    def non_text(self) -> str | None:
        """Why the content cannot be read (a part that is not text), or None."""
        for j, p in enumerate(self.content if isinstance(self.content, list) else []):
            if p.type != "text" or p.text is None:
                return (f"content[{j}] is a {p.type!r} part: this model reads text only; "
                        "send {\"type\": \"text\", \"text\": ...} parts")
        return None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "response"
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Function(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of these constrains the answer."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_flexible: bool | None = None


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for max_tokens; None = up to the model's context length."""
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    """Refused by name: echo is a /v1/completions field."""
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None
    """Passed to the chat template (`enable_thinking`, ...), as vLLM and SGLang do."""
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """vLLM's older names for structured_outputs' json / regex / choice / grammar."""

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        for i, m in enumerate(self.messages):
            why = m.non_text()
            if why:
                out.append((f"messages[{i}].content", why))
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.echo is not None:
            out.append(("echo", "echo is a /v1/completions field; chat answers never echo"))
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            out.append(("tool_choice", "tool_choice needs tools; send the tools it chooses from"))
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools and \
                self.tool_choice.function.name not in [t.function.name for t in self.tools]:
            out.append(("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, "
                        f"which is not among the tools {[t.function.name for t in self.tools]}"))
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and (
                rf.json_schema is None or rf.json_schema.schema_ is None):
            out.append(("response_format.json_schema", "json_schema needs a schema: "
                        "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., "
                        "\"schema\": {...}}}"))
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            out.append(("max_tokens", "send max_tokens or max_completion_tokens, not both"))
        return out

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
