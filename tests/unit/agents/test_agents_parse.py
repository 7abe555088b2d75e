"""Tool calls and reasoning read from an answer's text: exact OpenAI deltas, whatever the cut
into steps (several tokens a step, `</tool_call><tool_call>` in one chunk), and streamed deltas
that reassemble to the whole answer."""

from __future__ import annotations

import json

import pytest

from baton.agents.parse import OutputParser, OutputSpec

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                    "metric": {"type": "boolean"}, "where": {"type": "object"},
                                    "temp": {"type": "number"}}}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
XML = ("I will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
       "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
       "<parameter=where>\n{\"lat\": 1.5}\n</parameter>\n<parameter=temp>\n-2.5\n</parameter>\n"
       "</function>\n</tool_call><tool_call>\n<function=noop>\n</function>\n</tool_call>")
HERMES = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
          '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')


def stream(spec: OutputSpec, text: str, step: int) -> tuple[list[dict], OutputParser]:
    p = OutputParser(spec)
    deltas = [p.feed(text[i:i + step]) for i in range(0, len(text), step)]
    deltas.append(p.feed("", final=True))
    return [d for d in deltas if d], p


def reassemble(deltas: list[dict]) -> dict:
    out = {"content": "", "reasoning_content": "", "tool_calls": []}
    for d in deltas:
        out["content"] += d.get("content", "")
        out["reasoning_content"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] == len(out["tool_calls"]) and c["type"] == "function"
                out["tool_calls"].append({"id": c["id"], "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": c["function"]["arguments"]}})
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                out["tool_calls"][c["index"]]["function"]["arguments"] += \
                    c["function"]["arguments"]
    return out


def test_xml_calls_whole():
    p = OutputParser(OutputSpec("xml", TOOLS))
    p.feed(XML)
    msg = p.message()
    assert msg["content"] == "I will check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "New York", "days": 3, "metric": True, "where": {"lat": 1.5},
                         "temp": -2.5}), ("noop", {})]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in msg["tool_calls"])
    assert "reasoning_content" not in msg


def test_xml_exact_deltas_one_step_per_line():
    p = OutputParser(OutputSpec("xml", TOOLS[:1]))
    lines = ["Ok", "\n\n", "<tool_", "call>\n<function=get_weather>\n", "<parameter=city>\n",
             "Oslo\n</parameter>\n", "<parameter=days>\n2\n</parameter>\n</function>\n",
             "</tool_call>"]
    deltas = [p.feed(x) for x in lines] + [p.feed("", final=True)]
    cid = p.message()["tool_calls"][0]["id"]
    assert deltas == [
        {"content": "Ok"}, {}, {}, {"tool_calls": [{"index": 0, "id": cid, "type": "function",
                                                    "function": {"name": "get_weather",
                                                                 "arguments": ""}}]},
        {}, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "days": 2}'}}]},
        {}, {}]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 16, 1000])
@pytest.mark.parametrize("fmt,text", [("xml", XML), ("hermes", HERMES)], ids=["xml", "hermes"])
def test_streamed_deltas_reassemble_to_the_whole_answer_at_any_step(fmt, text, step):
    deltas, p = stream(OutputSpec(fmt, TOOLS), text, step)
    whole = p.message()
    got = reassemble(deltas)
    assert got["tool_calls"] == whole["tool_calls"]
    assert got["content"] == (whole["content"] or "")
    assert len(whole["tool_calls"]) == 2


def test_hermes_calls():
    p = OutputParser(OutputSpec("hermes", TOOLS))
    p.feed(HERMES)
    msg = p.message()
    assert msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [("get_weather", '{"city": "Oslo", "days": 2}'), ("noop", "{}")]


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_reasoning_then_content(step):
    text = "Let me think.\n</think>\n\nThe answer is 4."
    deltas, p = stream(OutputSpec("xml", None, reasoning=True), text, step)
    assert p.message() == {"content": "The answer is 4.", "reasoning_content": "Let me think.\n",
                           "reasoning": "Let me think.\n"}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think.\n"
    assert "".join(d.get("content", "") for d in deltas) == "The answer is 4."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_a_think_block_the_model_opens_itself():
    p = OutputParser(OutputSpec("xml", None))
    assert p.feed("<thi") == {}
    assert p.feed("nk>hmm</think>yes", final=True) == {
        "reasoning_content": "hmm", "reasoning": "hmm", "content": "yes"}


def test_a_tool_call_inside_thinking_ends_it():
    text = "I should call it.\n<tool_call>\n<function=noop>\n</function>\n</tool_call>"
    p = OutputParser(OutputSpec("xml", TOOLS, reasoning=True))
    p.feed(text)
    msg = p.message()
    assert msg["reasoning_content"] == "I should call it.\n"
    assert msg["tool_calls"][0]["function"] == {"name": "noop", "arguments": "{}"}


def test_parallel_tool_calls_false_keeps_the_first_call():
    p = OutputParser(OutputSpec("xml", TOOLS, parallel=False))
    p.feed(XML)
    assert [c["function"]["name"] for c in p.message()["tool_calls"]] == ["get_weather"]


def test_without_tools_tags_stay_text():
    p = OutputParser(OutputSpec("xml", None))
    assert p.feed(XML, final=True) == {"content": XML}


def test_an_unfinished_call_at_the_end_closes_with_its_complete_parameters():
    p = OutputParser(OutputSpec("xml", TOOLS))
    p.feed("<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n"
           "<parameter=city>\nOs")
    msg = p.message()
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"days": 4}'
