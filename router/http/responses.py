"""OpenAI's Responses API on top of chat completions: `POST /v1/responses` (whole or streamed
as Responses events), `GET /v1/responses/{id}`.

A request becomes a chat request: `instructions` a system message, `input` items (messages,
`function_call`, `function_call_output`) chat messages (a call its assistant message's
tool_calls, an output a `tool` message), `tools` chat tools, `text.format` a response_format;
the chat path renders, constrains and parses it (reasoning, tool calls), and its answer becomes
output items (`reasoning`, `message`, `function_call`).

`store` (default true) keeps the response and its whole conversation in the router's memory
(the newest `MAX_STORED`); `previous_response_id` continues it: the stored turns come first,
and the request runs under the conversation's session id (its first response's id), so the
router sends it to the decode worker that holds the conversation's decode-end state and every
earlier turn is reused, across prefill and decode.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from router.http.errors import ApiError
from router.http.schemas import ChatCompletionRequest

MAX_STORED = 4096
"""Stored responses kept (least recently stored dropped)."""


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: dict | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[dict] = ""
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict | None = None
    user: str | None = None
    reasoning: dict | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict | None = None
    background: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    seed: int | None = None
    """Baton's extra: the seed of the sampled answer."""

    def unsupported(self) -> list[tuple[str, str]]:
        out = []
        if self.background:
            out.append(("background", "background responses are not served; send "
                        "background: false (or leave it out) and stream instead"))
        if self.top_logprobs:
            out.append(("top_logprobs", "logprobs are served on /v1/chat/completions"))
        if self.include and any(i != "reasoning.encrypted_content" for i in self.include):
            out.append(("include", f"{self.include} are not served"))
        return out
    chat_template_kwargs: dict | None = None


@dataclass(frozen=True)
class Turn:
    """A stored turn's tokens: its rendered prompt text, the ids it ran with, and the ids the
    model drew (the next turn starts with exactly these: `spliced`)."""

    text: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


class Store:
    """Stored responses: id -> (response, conversation messages after it, session id, the
    turn's tokens)."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit = limit
        self._items: OrderedDict[str, tuple[dict, list[dict], str, Turn]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, messages: list[dict], session: str, turn: Turn) -> None:
        with self._lock:
            self._items[response["id"]] = (response, messages, session, turn)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict], str, Turn] | None:
        with self._lock:
            return self._items.get(rid)


def spliced(tok, before: Turn, text: str, ids: list[int]) -> list[int]:
    """The prompt of a turn that continues `before`: when its rendered `text` starts with the
    earlier prompt's text and the earlier answer's text as the model wrote it (the template
    re-renders the answer as generated), the earlier turn's own token ids, then the rest of
    `text` encoded. The model then reads exactly the tokens it drew, not a re-tokenization of
    their text, and the decode worker's state after them (the decode-end snapshot) is a prefix
    of the prompt. Else `ids` (the plain rendering) unchanged."""
    if tok is None:
        return ids
    out = list(before.output_ids)
    while out and tok.decode([out[-1]]) == "":  # the end token: the template renders its own
        out.pop()
    head = before.text + tok.decode(out)
    if not text.startswith(head):
        return ids
    return [*before.prompt_ids, *out, *tok.encode(text[len(head):])]


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    out = []
    for i, t in enumerate(tools or []):
        if t.get("type") != "function":
            raise ApiError(400, f"tools[{i}]: only function tools are served, got type "
                           f"{t.get('type')!r}", f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise ApiError(400, "tool_choice: name a function tool as {\"type\": \"function\", "
                           "\"name\": ...} or send none / auto / required", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for p in content or []:
        if p.get("type") not in ("input_text", "output_text", "text", "summary_text",
                                 "reasoning_text"):
            raise ApiError(400, f"input: a {p.get('type')!r} content part: this model reads "
                           "text only", "input")
        parts.append(p.get("text", ""))
    return "".join(parts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """Responses input items -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning = None
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"input[{i}].role: {role!r} is not a message role",
                               f"input[{i}].role")
            msg = {"role": role, "content": _text_of(item.get("content"))}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and \
                    (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text_of(output)})
        elif kind == "reasoning":
            reasoning = "".join(p.get("text", "") for p in
                                (item.get("content") or item.get("summary") or []))
        else:
            raise ApiError(400, f"input[{i}].type: {kind!r} items are not served (messages, "
                           "function_call, function_call_output, reasoning are)",
                           f"input[{i}].type")
    return out


def response_format(text: TextConfig | None) -> dict | None:
    fmt = (text.format if text is not None else None) or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}
    raise ApiError(400, f"text.format.type: {kind!r} is not one of text, json_object, "
                   "json_schema", "text.format.type")


def chat_body(body: ResponsesRequest, history: list[dict], session: str) -> dict:
    messages = [*([{"role": "system", "content": body.instructions}] if body.instructions
                  else []), *history, *input_messages(body.input)]
    if not messages:
        raise ApiError(400, "input is empty: send a message", "input")
    chat = {"model": body.model, "messages": messages, "session_id": session,
            "stream": bool(body.stream), "return_token_ids": True}
    if body.max_tool_calls == 1:
        chat["parallel_tool_calls"] = False
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                     ("max_output_tokens", "max_tokens"),
                     ("parallel_tool_calls", "parallel_tool_calls"),
                     ("chat_template_kwargs", "chat_template_kwargs")):
        if getattr(body, src) is not None:
            chat[dst] = getattr(body, src)
    tools = chat_tools(body.tools)
    if tools:
        chat["tools"] = tools
    if body.tool_choice is not None and (tools or body.tool_choice == "none"):
        chat["tool_choice"] = chat_tool_choice(body.tool_choice)
    rf = response_format(body.text)
    if rf is not None:
        chat["response_format"] = rf
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    return chat


def to_chat_request(chat: dict) -> ChatCompletionRequest:
    from pydantic import ValidationError

    from router.http.errors import from_validation

    try:
        return ChatCompletionRequest.model_validate_json(json.dumps(chat))
    except ValidationError as e:
        raise from_validation(e) from None


# ---- the answer as a response ---------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict) -> list[dict]:
    items = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": new_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text",
                                   "text": message["reasoning_content"]}]})
    if message.get("content"):
        items.append(_message_item(new_id("msg"), message["content"]))
    for c in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": c["id"],
                      "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                      "status": "completed"})
    return items


def _message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def response_object(rid: str, body: ResponsesRequest, output: list[dict], usage: dict | None,
                    finish: str | None, created: float) -> dict:
    u = usage or {}
    incomplete = finish == "length"
    return {
        "id": rid, "object": "response", "created_at": created, "model": body.model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "instructions": body.instructions, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
        "tools": body.tools or [], "temperature": body.temperature, "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id, "store": body.store is not False,
        "text": {"format": (body.text.format if body.text and body.text.format
                            else {"type": "text"})},
        "metadata": body.metadata or {}, "reasoning": body.reasoning,
        "usage": {"input_tokens": u.get("prompt_tokens", 0),
                  "input_tokens_details": {"cached_tokens": u.get(
                      "prompt_tokens_details", {}).get("cached_tokens", 0)},
                  "output_tokens": u.get("completion_tokens", 0),
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": u.get("total_tokens", 0)},
    }


def answer_message(message: dict) -> dict:
    """The answer as the assistant message a later turn renders."""
    answer = {"role": "assistant", "content": message.get("content") or None}
    if message.get("reasoning_content"):
        answer["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        answer["tool_calls"] = message["tool_calls"]
    return answer


class StreamTranslator:
    """Chat completion chunks -> Responses stream events, item by item."""

    def __init__(self, rid: str, body: ResponsesRequest, created: float):
        self.rid, self.body, self.created = rid, body, created
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}
        self.message = {"content": "", "reasoning_content": "", "tool_calls": []}
        self.usage: dict | None = None
        self.finish: str | None = None

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        shell = response_object(self.rid, self.body, [], None, None, self.created)
        shell["status"] = "in_progress"
        return [self._event("response.created", response=shell),
                self._event("response.in_progress", response=shell)]

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        idx = len(self.items)
        self.items.append(item)
        out = []
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=idx,
                                content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"],
                                output_index=idx, content_index=0, part=item["content"][0])]
        elif item["type"] == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                   output_index=idx, content_index=0,
                                   text=item["content"][0]["text"]))
        elif item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done",
                                   item_id=item["id"], output_index=idx,
                                   name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed" if item["type"] != "reasoning" else None
        if item["type"] == "reasoning":
            item.pop("status")
        out.append(self._event("response.output_item.done", output_index=idx, item=item))
        return out

    def _open(self, item: dict) -> list[dict]:
        out = self._close()
        self.open = item
        idx = len(self.items)
        added = json.loads(json.dumps(item))
        out.append(self._event("response.output_item.added", output_index=idx, item=added))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=idx, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": [],
                                         "logprobs": []}))
        return out

    def chunk(self, chunk: dict) -> list[dict]:
        out = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            d = choice.get("delta", {})
            idx = len(self.items)
            if d.get("reasoning_content"):
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._open({"type": "reasoning", "id": new_id("rs"), "summary": [],
                                       "content": [{"type": "reasoning_text", "text": ""}]})
                    idx = len(self.items)
                self.open["content"][0]["text"] += d["reasoning_content"]
                self.message["reasoning_content"] += d["reasoning_content"]
                out.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                       output_index=idx, content_index=0,
                                       delta=d["reasoning_content"]))
            if d.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._open(_message_item(new_id("msg"), "", "in_progress"))
                    idx = len(self.items)
                self.open["content"][0]["text"] += d["content"]
                self.message["content"] += d["content"]
                out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                       output_index=idx, content_index=0, delta=d["content"],
                                       logprobs=[]))
            for c in d.get("tool_calls") or []:
                if "id" in c:
                    item = {"type": "function_call", "id": new_id("fc"), "call_id": c["id"],
                            "name": c["function"]["name"], "arguments": "",
                            "status": "in_progress"}
                    out += self._open(item)
                    self.calls[c["index"]] = item
                    self.message["tool_calls"].append({"id": c["id"], "type": "function",
                                                       "function": {"name": item["name"],
                                                                    "arguments": ""}})
                frag = c.get("function", {}).get("arguments", "")
                if frag:
                    item = self.calls[c["index"]]
                    item["arguments"] += frag
                    self.message["tool_calls"][c["index"]]["function"]["arguments"] += frag
                    out.append(self._event("response.function_call_arguments.delta",
                                           item_id=item["id"], output_index=len(self.items),
                                           delta=frag))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> tuple[list[dict], dict]:
        out = self._close()
        response = response_object(self.rid, self.body, self.items, self.usage, self.finish,
                                   self.created)
        kind = "response.incomplete" if response["status"] == "incomplete" else \
            "response.completed"
        out.append(self._event(kind, response=response))
        return out, response


def now() -> float:
    return time.time()
