"""Tools over the HTTP API with a scripted orchestrator (no workers): the prompt the template
renders with tools, tool calls and reasoning in whole and streamed answers (the official openai
client reassembles the stream to the whole answer), finish_reason "tool_calls", 400s."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from baton.contract import FinishReason, GenerateChunk, GenerateSummary
from baton.model.chat_template import TINY_CHAT_TEMPLATE, ChatTemplate
from baton.model.qwen3_5.chat_template import TEMPLATE as QWEN3_5_TEMPLATE
from baton.model.tokenizer import ByteTokenizer
from router.http.app import HttpContext
from router.http.server import HttpServer
from router.metrics import RouterMetrics
from tests.unit.router.http.test_http_frontend import ScriptedOrchestrator, request, sse

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


# ---- /v1/responses ---------------------------------------------------------------------------

RTOOLS = [{"type": "function", "name": "add", "parameters": TOOLS[0]["function"]["parameters"]}]


def test_responses_text_then_continued_by_previous_response_id(tiny):
    orch, client, port = tiny
    orch.script = lambda inp, cancel: iter(chunks_of("Hello there.", 4))
    first = client.responses.create(model="tiny", input="Hi", instructions="Be kind.")
    assert first.output_text == "Hello there." and first.status == "completed"
    inp1 = orch.calls[-1][0]
    assert ByteTokenizer().decode(list(inp1.prompt_ids)) == \
        "<|system|>\nBe kind.\n<|user|>\nHi\n<|assistant|>\n"
    assert inp1.session_id == first.id
    orch.script = lambda inp, cancel: iter(chunks_of("Fine.", 2))
    second = client.responses.create(model="tiny", input="How are you?",
                                     previous_response_id=first.id)
    inp2 = orch.calls[-1][0]
    assert ByteTokenizer().decode(list(inp2.prompt_ids)) == (
        "<|user|>\nHi\n<|assistant|>\nHello there.\n<|user|>\nHow are you?\n<|assistant|>\n")
    assert inp2.session_id == first.id  # the conversation's decode worker again
    assert second.output_text == "Fine." and second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == "Fine."
    for body, param in (({"previous_response_id": "resp_nope"}, "previous_response_id"),
                        ({"background": True}, "background"),
                        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
                        ({"input": [{"type": "web_search_call"}]}, "input[0].type")):
        code, raw = request(port, "/v1/responses", {"model": "tiny", "input": "x", **body})
        assert code == 400 and json.loads(raw)["error"]["param"] == param, raw


def test_responses_function_calls_and_their_outputs(tiny):
    orch, client, _ = tiny
    orch.script = lambda inp, cancel: iter(chunks_of(CALL, 6))
    first = client.responses.create(model="tiny", input="2+40?", tools=RTOOLS)
    calls = [o for o in first.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 40})]
    assert first.output[0].type == "message" and first.output_text == "Adding."
    orch.script = lambda inp, cancel: iter(chunks_of("It is 42.", 3))
    second = client.responses.create(
        model="tiny", tools=RTOOLS, previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "42"}])
    prompt = ByteTokenizer().decode(list(orch.calls[-1][0].prompt_ids))
    assert prompt.endswith("<|assistant|>\nAdding.\n<tool_call>\n<function=add>\n"
                           "<parameter=a>\n2\n</parameter>\n<parameter=b>\n40\n</parameter>\n"
                           "</function>\n</tool_call>\n<|tool|>\n42\n<|assistant|>\n")
    assert second.output_text == "It is 42."


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_responses_streamed_events_build_the_same_response(tiny, step):
    orch, client, _ = tiny
    orch.script = lambda inp, cancel: iter(chunks_of(CALL, step))
    with client.responses.stream(model="tiny", input="2+40?", tools=RTOOLS) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and \
        "response.function_call_arguments.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "Adding."
    call = [o for o in final.output if o.type == "function_call"][0]
    assert (call.name, call.arguments) == ("add", '{"a": 2, "b": 40}')
    assert client.responses.retrieve(final.id).output[1].arguments == call.arguments


def test_responses_text_format_json_schema_is_a_grammar(tiny):
    orch, client, _ = tiny
    orch.script = lambda inp, cancel: iter(chunks_of('{"a":1}', 3))
    client.responses.create(model="tiny", input="x", text={"format": {
        "type": "json_schema", "name": "A", "strict": True, "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
            "additionalProperties": False}}})
    assert "%json" in orch.calls[-1][0].sampling.grammar


def test_chat_requests_are_counted_by_tool_choice_and_response_format(tiny):
    orch, client, port = tiny
    orch.script = lambda inp, cancel: iter(chunks_of(CALL, 50))
    client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                   tool_choice="required")
    client.chat.completions.create(model="tiny", messages=MESSAGES,
                                   response_format={"type": "json_object"})
    _, raw = request(port, "/metrics", None, "GET")
    text = raw.decode()
    for labels in ('response_format="text",tool_choice="required"',
                   'response_format="json_object",tool_choice="none"'):
        line = next(x for x in text.splitlines()
                    if x.startswith("baton_router_chat_requests_total{") and labels in x)
        assert float(line.split()[-1]) >= 1


def test_a_continued_response_starts_with_the_earlier_turns_own_tokens(tiny):
    """The next turn's prompt is the earlier prompt's ids and the ids the model drew (its end
    token, which this template does not render, left out), then the new turn's text."""
    orch, client, _ = tiny
    tok = ByteTokenizer()

    def answer(text):
        ids = tok.encode(text) + [2]  # EOS, which the tiny template does not render
        chunks = [GenerateChunk("r", (i,), tok.decode([i])) for i in ids[:-1]]
        summary = GenerateSummary(FinishReason.STOP, 3, 0, "p0", "d0", 1.0, 2.0, 0)
        chunks.append(GenerateChunk("r", (2,), "", summary))
        return lambda inp, cancel: iter(chunks)

    orch.script = answer(CALL)
    first = client.responses.create(model="tiny", input="2+40?", tools=RTOOLS)
    p1 = list(orch.calls[-1][0].prompt_ids)
    call = [o for o in first.output if o.type == "function_call"][0]
    orch.script = answer("42.")
    client.responses.create(model="tiny", tools=RTOOLS, previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "42"}])
    p2 = list(orch.calls[-1][0].prompt_ids)
    assert p2[:len(p1) + len(tok.encode(CALL))] == p1 + tok.encode(CALL)
    assert tok.decode(p2).endswith("</tool_call>\n<|tool|>\n42\n<|assistant|>\n")


def test_auto_with_a_strict_tool_is_constrained(tiny):
    """`tool_choice` "auto" (or left out) with a strict tool: text or calls under a grammar;
    no strict tool, or "none": free; an explicit response_format applies alone."""
    orch, client, _ = tiny
    orch.script = lambda inp, cancel: iter(chunks_of(CALL, 50))
    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
    grammars = []
    for tools, extra in ((strict, {}), (strict, {"tool_choice": "auto"}),
                         (strict, {"parallel_tool_calls": False}), (TOOLS, {}),
                         (strict, {"tool_choice": "none"}),
                         (strict, {"response_format": {"type": "json_object"}})):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, **extra)
        grammars.append(orch.calls[-1][0].sampling.grammar)
    assert "OPENER" in grammars[0] and grammars[0] == grammars[1]
    assert "OPENER" in grammars[2] and grammars[2] != grammars[0]
    assert grammars[3] == grammars[4] == ""
    assert "%json" in grammars[5] and "OPENER" not in grammars[5]
