"""Tools over the HTTP API with a scripted orchestrator (no workers): the prompt the template
renders with tools, tool calls and reasoning in whole and streamed answers (the official openai
client reassembles the stream to the whole answer), finish_reason "tool_calls", 400s."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from baton.contract import FinishReason, GenerateChunk, GenerateSummary
from baton.model.chat_template import TINY_CHAT_TEMPLATE, ChatTemplate
from baton.model.tokenizer import ByteTokenizer
from baton.model.tool_templates import QWEN3_5_TEMPLATE
from router.http.app import HttpContext
from router.http.server import HttpServer
from router.metrics import RouterMetrics
from tests.unit.test_http_frontend import ScriptedOrchestrator, request, sse

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}]
CALL = ("Adding.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n"
        "40\n</parameter>\n</function>\n</tool_call>")


def chunks_of(text: str, step: int, reason=FinishReason.STOP):
    parts = [text[i:i + step] for i in range(0, len(text), step)]
    out = [GenerateChunk("r", (10 + i,), t) for i, t in enumerate(parts)]
    summary = GenerateSummary(reason, 3, 0, "p0", "d0", 1.0, 2.0, 0)
    out[-1] = GenerateChunk("r", out[-1].token_ids, out[-1].text, summary)
    return out


def serve(template: str):
    orch = ScriptedOrchestrator()
    ctx = HttpContext(orch, RouterMetrics(orch.registry), "tiny", ChatTemplate(template),
                      max_model_len=4096, max_body_bytes=65536, pool=ThreadPoolExecutor(8))
    return orch, HttpServer(ctx, "127.0.0.1", 0)


@pytest.fixture(scope="module")
def tiny():
    orch, server = serve(TINY_CHAT_TEMPLATE)
    yield orch, openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                              max_retries=0), server.port
    server.stop()


@pytest.fixture(scope="module")
def qwen():
    orch, server = serve(QWEN3_5_TEMPLATE)
    yield orch, openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                              max_retries=0), server.port
    server.stop()


MESSAGES = [{"role": "user", "content": "2+40?"}]


def test_tools_reach_the_prompt_and_calls_come_back(tiny):
    orch, client, _ = tiny
    orch.script = lambda inp, cancel: iter(chunks_of(CALL, 5))
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS)
    prompt = ByteTokenizer().decode(list(orch.calls[-1][0].prompt_ids))
    assert '"name": "add"' in prompt and prompt.endswith("<|assistant|>\n")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 40})


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_calls_reassemble_to_the_whole_answer(tiny, step):
    orch, client, _ = tiny
    orch.script = lambda inp, cancel: iter(chunks_of(CALL, step))
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=TOOLS) as s:
        events = list(s)
        final = s.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
    assert choice.message.tool_calls[0].function.arguments == '{"a": 2, "b": 40}'
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [("add", '{"a": 2, "b": 40}')]


def test_a_follow_up_turn_renders_the_call_and_its_result(tiny):
    orch, client, _ = tiny
    orch.script = lambda inp, cancel: iter(chunks_of("42", 1))
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add",
                                                          "arguments": '{"a": 2, "b": 40}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    assert out.choices[0].message.content == "42" and out.choices[0].finish_reason == "stop"
    prompt = ByteTokenizer().decode(list(orch.calls[-1][0].prompt_ids))
    assert "<function=add>\n<parameter=a>\n2\n</parameter>" in prompt
    assert prompt.endswith("<|tool|>\n42\n<|assistant|>\n")


def test_reasoning_of_a_thinking_template(qwen):
    orch, client, port = qwen
    text = "Two plus forty.\n</think>\n\n42"
    orch.script = lambda inp, cancel: iter(chunks_of(text, 3))
    out = client.chat.completions.create(model="tiny", messages=MESSAGES)
    msg = out.choices[0].message
    assert msg.content == "42"
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == \
        "Two plus forty.\n"
    code, raw = request(port, "/v1/chat/completions", {
        "model": "tiny", "messages": MESSAGES, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse(raw)[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two plus forty.\n"
    assert "".join(d.get("content", "") for d in deltas) == "42"
    # thinking off: the prompt closes the block, the answer is content
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}})
    prompt = ByteTokenizer().decode(list(orch.calls[-1][0].prompt_ids))
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert out.choices[0].message.content == text


def test_bad_input_is_a_400_naming_the_field(qwen, tiny):
    _, _, port = qwen
    cases = [
        ({"messages": [{"role": "system", "content": "x"}]}, "messages",
         "No user query found in messages"),
        ({"messages": MESSAGES, "tools": TOOLS, "tool_choice": {
            "type": "function", "function": {"name": "mul"}}}, "tool_choice", "'mul'"),
        ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{1"}}]}]},
         "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ]
    for body, param, words in cases:
        code, raw = request(port, "/v1/chat/completions", {"model": "tiny", **body})
        err = json.loads(raw)["error"]
        assert (code, err["param"]) == (400, param) and words in err["message"], err


def test_a_template_without_tool_support_refuses_tools():
    orch, server = serve("{% for m in messages %}{{ m.content }}{% endfor %}")
    try:
        code, raw = request(server.port, "/v1/chat/completions", {
            "model": "tiny", "messages": MESSAGES, "tools": TOOLS})
        assert code == 400 and json.loads(raw)["error"]["param"] == "tools"
    finally:
        server.stop()
