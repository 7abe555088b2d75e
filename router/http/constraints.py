"""A chat request's constraint -> the grammar text its workers mask with (baton/agents/
grammar.py), or "" when the answer is free.

Which one applies: `tool_choice` "required" or a named function (the calls in the model's own
format), else `response_format` json_object / json_schema, else vLLM's `structured_outputs`
(json, regex, choice, grammar, json_object) or its older `guided_*` names. Only one may be
given; `response_format` with a tool constraint is refused (SGLang drops one silently).
`tool_choice: "auto"` (or left out) with a `strict` tool: free text, or calls whose arguments
follow their tools' schemas, as vLLM does (its VLLM_ENFORCE_STRICT_TOOL_CALLING default); an
explicit constraint beside it applies alone (the answer's text follows it, so may not call).
"""

from __future__ import annotations

import json

from baton.agents import grammar as g
from baton.errors import InvalidRequestError


def chat_grammar(body, call_format: str, tools: list[dict] | None,
                 reasoning: bool) -> tuple[str, str, str]:
    """(grammar text, tool_choice label, response_format label) for metrics."""
    flexible = bool(body.structured_outputs and body.structured_outputs.whitespace_flexible)
    lark, field = _lark(body, call_format, tools, flexible)
    tc = body.tool_choice
    tc_label = "none" if not tools else ("named" if not isinstance(tc, str | None)
                                         else (tc or "auto"))
    rf_label = body.response_format.type if body.response_format else (
        "structured_outputs" if field and field not in ("tool_choice", "tools") else "text")
    if not lark:
        return "", tc_label, rf_label
    if reasoning:
        lark = g.with_reasoning(lark)
    return g.compile_text(lark, field), tc_label, rf_label


def _lark(body, call_format: str, tools, flexible: bool) -> tuple[str, str]:
    tc = body.tool_choice
    rf = body.response_format
    so = body.structured_outputs
    guided = {k: getattr(body, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
              if getattr(body, f"guided_{k}") is not None}
    given = [name for name, on in (
        ("tool_choice", tools and (tc == "required" or not isinstance(tc, str | None))),
        ("response_format", rf is not None and rf.type != "text"),
        ("structured_outputs", so is not None), ("guided_*", bool(guided))) if on]
    if len(given) > 1:
        raise InvalidRequestError(f"{given[1]}: only one constraint applies to an answer, and "
                                  f"{given[0]} is given too; send one of them")
    if not given:
        if tools and tc in ("auto", None) and any(_strict(t) for t in tools):
            return g.calls_lark(tools, call_format, body.parallel_tool_calls is False,
                                flexible, free=True), "tools"
        return "", ""
    field = given[0]
    if field == "tool_choice":
        if isinstance(tc, str):
            chosen, one = tools, body.parallel_tool_calls is False
        else:
            chosen = [t for t in tools if t["function"]["name"] == tc.function.name]
            one = True
        return g.calls_lark(chosen, call_format, one, flexible), field
    if field == "response_format":
        if rf.type == "json_object":
            return "start: " + g.json_lark({"type": "object"}, flexible), field
        return "start: " + g.json_lark(_schema(rf.json_schema.schema_,
                                               "response_format.json_schema.schema"),
                                       flexible), "response_format.json_schema.schema"
    if field == "structured_outputs":
        set_ = {k: v for k, v in (("json", so.json_), ("regex", so.regex),
                                  ("choice", so.choice), ("grammar", so.grammar),
                                  ("json_object", so.json_object)) if v not in (None, False)}
        if len(set_) != 1:
            raise InvalidRequestError(
                f"structured_outputs: give exactly one of json, regex, choice, grammar, "
                f"json_object; got {sorted(set_) or 'none'}")
        kind, value = next(iter(set_.items()))
        return _extra(kind, value, f"structured_outputs.{kind}", flexible)
    kind, value = next(iter(guided.items()))
    if len(guided) > 1:
        raise InvalidRequestError(f"guided_{kind}: give one guided_* field, got "
                                  f"{sorted('guided_' + k for k in guided)}")
    return _extra(kind, value, f"guided_{kind}", flexible)


def _extra(kind: str, value, field: str, flexible: bool) -> tuple[str, str]:
    if kind == "json":
        return "start: " + g.json_lark(_schema(value, field), flexible), field
    if kind == "json_object":
        return "start: " + g.json_lark({"type": "object"}, flexible), field
    if kind == "regex":
        from llguidance import LLMatcher

        return _from_grammar(LLMatcher.grammar_from_regex(value), field), field
    if kind == "choice":
        if not value:
            raise InvalidRequestError(f"{field}: give at least one choice")
        return "start: " + " | ".join(json.dumps(c) for c in value), field
    return value, field  # a Lark grammar as llguidance reads it


def _strict(tool: dict) -> bool:
    return bool(tool.get("function", tool).get("strict"))


def _from_grammar(grammar_json: str, field: str) -> str:
    """The Lark text inside llguidance's grammar JSON (regex, as it builds it)."""
    try:
        return json.loads(grammar_json)["grammars"][0]["lark_grammar"]
    except (KeyError, IndexError, json.JSONDecodeError):
        raise InvalidRequestError(f"{field}: the grammar cannot be built") from None


def _schema(value, field: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{field}: not valid JSON: {e.msg}") from None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{field}: a JSON schema is an object")
    return value
