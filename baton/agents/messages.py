"""OpenAI chat messages -> the dicts a checkpoint's chat template iterates.

As vLLM does before rendering: an assistant's `tool_calls[].function.arguments` (a JSON string
on the wire) becomes an object, since the templates iterate `arguments|items`; `reasoning`
(vLLM's newer name) becomes `reasoning_content`, the name the templates read; `developer` is
rendered as `system`; a null content as "". A malformed call is the client's error, named by
its message index.
"""

from __future__ import annotations

import json

from baton.errors import InvalidRequestError


def template_messages(messages: list[dict]) -> list[dict]:
    """`messages` (each a dict as the client sent it, parsed) ready for the template."""
    return [_one(i, m) for i, m in enumerate(messages)]


def _one(i: int, m: dict) -> dict:
    role = "system" if m["role"] == "developer" else m["role"]
    out = {"role": role, "content": m.get("content") or ""}
    for key in ("name", "tool_call_id"):
        if m.get(key):
            out[key] = m[key]
    reasoning = m.get("reasoning_content")
    if reasoning is None:
        reasoning = m.get("reasoning")
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant":
            raise InvalidRequestError(f"messages[{i}].tool_calls: only an assistant message "
                                      f"holds tool calls, this one is {role!r}")
        out["tool_calls"] = [_call(i, j, c) for j, c in enumerate(calls)]
    if role == "tool" and not m.get("tool_call_id"):
        raise InvalidRequestError(f"messages[{i}].tool_call_id: a tool message names the call "
                                  "it answers; send its tool_call_id")
    return out


def _call(i: int, j: int, call: dict) -> dict:
    fn = call.get("function") or {}
    where = f"messages[{i}].tool_calls[{j}].function"
    if not fn.get("name"):
        raise InvalidRequestError(f"{where}.name: a tool call names its function")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(
                f"{where}.arguments: not valid JSON ({e.msg} at character {e.pos}): "
                f"{args[:80]!r}; send the arguments as a JSON object string") from None
    if not isinstance(args, dict):
        raise InvalidRequestError(f"{where}.arguments: must be a JSON object, got "
                                  f"{type(args).__name__}")
    return {"id": call.get("id") or f"call_{i}_{j}", "type": "function",
            "function": {"name": fn["name"], "arguments": args}}
