"""A chat answer's text -> reasoning, content and tool calls, whole or as OpenAI stream deltas.

The call format is the checkpoint's (`ChatTemplate.call_format`):
  xml     `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n
          </tool_call>` (Qwen3.5, Nemotron 3, the tiny model); each VALUE typed from the tool's
          schema as vLLM's qwen3_coder parser does (integer, number, boolean, object / array as
          JSON, null; else the string)
  hermes  `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>` (Qwen3-Next)
Reasoning is the text before `</think>` when the prompt opened a `<think>` block (or the answer
starts with `<think>`); a `<tool_call>` also ends it (Qwen3.5 may call from inside its
thinking, vLLM #39056).

Streaming never depends on how the text was cut into steps (speculation delivers several tokens
at once, `</tool_call><tool_call>` may be one chunk): every `feed` re-reads the whole text so far
and sends what is new since the last delta; text that may still become a tag is held back. A
call goes out first as its index, id, type and name (arguments ""), then argument fragments that
concatenate to the non-streamed answer's arguments: for xml one fragment per complete parameter
and the closing brace, for hermes the arguments once the call is complete.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAM = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.DOTALL)
_HERMES_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class Call:
    name: str
    arguments: str = ""
    """JSON text so far (complete once `done`)."""
    done: bool = False
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)


@dataclass
class OutputSpec:
    """How a chat request's answers are read."""

    call_format: str = "xml"
    tools: list[dict] | None = None
    """The request's tools (OpenAI shape) when calls are parsed; None: tool calls stay text."""
    reasoning: bool = False
    """The prompt opened a `<think>` block: the answer starts in reasoning."""
    parallel: bool = True
    """False: at most one call (parallel_tool_calls false); text after it is dropped."""


class OutputParser:
    def __init__(self, spec: OutputSpec):
        self.spec = spec
        self.text = ""
        self._ids: list[str] = []
        self._sent = Parsed()

    def parse(self, final: bool = False) -> Parsed:
        """The whole text so far, read; `final`: nothing more comes (held text released)."""
        text, out = self.text, Parsed()
        start = 0
        opened = self.spec.reasoning
        if not opened and not final and text.strip() and THINK_OPEN.startswith(text.lstrip()):
            return out  # may still open a <think> block
        if not opened and text.lstrip().startswith(THINK_OPEN):
            opened, start = True, text.index(THINK_OPEN) + len(THINK_OPEN)
        if opened:
            ends = [(text.find(t, start), t) for t in (THINK_CLOSE, CALL_OPEN)
                    if text.find(t, start) >= 0 and (t == THINK_CLOSE or self.spec.tools)]
            if not ends:
                out.reasoning = text[start:] if final else _held(text[start:], self._tags())
                return out
            at, tag = min(ends)
            out.reasoning = text[start:at]
            start = at + len(THINK_CLOSE) if tag == THINK_CLOSE else at
            if tag == THINK_CLOSE:
                while start < len(text) and text[start] == "\n":
                    start += 1
        self._answer(text[start:], out, final)
        return out

    def _tags(self) -> tuple[str, ...]:
        return (THINK_CLOSE, CALL_OPEN) if self.spec.tools else (THINK_CLOSE,)

    def _answer(self, text: str, out: Parsed, final: bool) -> None:
        if not self.spec.tools:
            out.content = text
            return
        at = text.find(CALL_OPEN)
        if at < 0:  # newlines wait too: before a call they are not content
            out.content = text if final else _held(text, (CALL_OPEN,)).rstrip("\n")
            return
        out.content = text[:at].rstrip("\n")
        rest = text[at:]
        while rest.startswith(CALL_OPEN):
            end = rest.find(CALL_CLOSE)
            body = rest[len(CALL_OPEN): end if end >= 0 else len(rest)]
            call = self._call(body, end >= 0 or final, len(out.calls))
            if call is not None:
                out.calls.append(call)
            if end < 0 or (not self.spec.parallel and out.calls):
                return
            rest = rest[end + len(CALL_CLOSE):].lstrip()
        if rest and out.calls:  # text after the calls: content, as it came
            tail = rest if final else _held(rest, (CALL_OPEN,))
            if tail.strip():
                out.content += ("\n" if out.content else "") + tail

    def _call(self, body: str, closed: bool, index: int) -> Call | None:
        while len(self._ids) <= index:
            self._ids.append("call_" + uuid.uuid4().hex[:24])
        if self.spec.call_format == "hermes":
            return self._hermes(body, closed, index)
        m = _FUNCTION.search(body)
        if m is None:
            return None
        name = m.group(1).strip()
        params = self._schema(name)
        parts = [f"{json.dumps(p.group(1).strip(), ensure_ascii=False)}: "
                 f"{json.dumps(_typed(p.group(2), params.get(p.group(1).strip())), ensure_ascii=False)}"
                 for p in _PARAM.finditer(body, m.end())]
        args = ", ".join(parts)
        done = closed or "</function>" in body
        args = ("{" + args + "}") if done else ("{" + args if parts else "")
        return Call(name, args, done, self._ids[index])

    def _hermes(self, body: str, closed: bool, index: int) -> Call | None:
        m = _HERMES_NAME.search(body)
        if m is None:
            return None
        name = json.loads(f'"{m.group(1)}"')
        if not closed:
            return Call(name, "", False, self._ids[index])
        try:
            obj = json.loads(body.strip())
            args = obj.get("arguments", obj.get("parameters", {}))
        except (json.JSONDecodeError, AttributeError):
            args = {}
        if isinstance(args, str):
            return Call(name, args, True, self._ids[index])
        return Call(name, json.dumps(args, ensure_ascii=False), True, self._ids[index])

    def _schema(self, name: str) -> dict:
        for t in self.spec.tools or []:
            fn = t.get("function", t)
            if fn.get("name") == name:
                return (fn.get("parameters") or {}).get("properties") or {}
        return {}

    # ---- streaming -----------------------------------------------------------------------
    def feed(self, text: str, final: bool = False) -> dict:
        """Adds `text`; the OpenAI delta fields it makes (possibly none)."""
        self.text += text
        now = self.parse(final)
        delta: dict = {}
        sent = self._sent
        if len(now.reasoning) > len(sent.reasoning):
            delta["reasoning_content"] = delta["reasoning"] = now.reasoning[len(sent.reasoning):]
            sent.reasoning = now.reasoning
        if len(now.content) > len(sent.content) and now.content.startswith(sent.content):
            delta["content"] = now.content[len(sent.content):]
            sent.content = now.content
        calls = []
        for i, call in enumerate(now.calls):
            if i >= len(sent.calls):
                calls.append({"index": i, "id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": ""}})
                sent.calls.append(Call(call.name, "", False, call.id))
            before = sent.calls[i].arguments
            if len(call.arguments) > len(before) and call.arguments.startswith(before):
                calls.append({"index": i, "function": {"arguments": call.arguments[len(before):]}})
                sent.calls[i].arguments = call.arguments
        if calls:
            delta["tool_calls"] = calls
        return delta

    def message(self) -> dict:
        """The whole answer as a chat message's fields."""
        p = self.parse(final=True)
        out: dict = {"content": p.content if (p.content or not p.calls) else None}
        if p.reasoning or self.spec.reasoning:
            out["reasoning_content"] = out["reasoning"] = p.reasoning
        if p.calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in p.calls]
        return out

    def has_calls(self) -> bool:
        return bool(self.parse(final=True).calls)


def _held(text: str, tags: tuple[str, ...]) -> str:
    """`text` less a tail that may still grow into one of `tags`."""
    cut = len(text)
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]


def _typed(raw: str, schema: dict | None):
    """A parameter's text as the value its schema types (vLLM qwen3_coder's rules)."""
    if raw.strip().lower() == "null":
        return None
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind is None and schema and "enum" not in schema and ("anyOf" in schema or "$ref" in schema):
        kind = "object"
    if kind in (None, "string"):
        return raw
    text = raw.strip()
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            v = float(text)
            return int(v) if v.is_integer() and "." not in text and "e" not in text.lower() else v
        if kind == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            return raw
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        return raw
