"""Chat templates with tools render as transformers renders them (apply_chat_template's
renderer, `render_jinja_template`), for every template Baton ships; a template's own
raise_exception and a malformed tool call in history are 400s naming their message."""

from __future__ import annotations

import pytest

from baton.agents.messages import template_messages
from baton.errors import InvalidRequestError
from baton.model.chat_template import TINY_CHAT_TEMPLATE, ChatTemplate
from baton.model.nemotron_h.chat_template import TEMPLATE as NEMOTRON3_TEMPLATE
from baton.model.qwen3_5.chat_template import TEMPLATE as QWEN3_5_TEMPLATE
from baton.model.tool_templates import HERMES_TEMPLATE

chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")

TEMPLATES = {"tiny": TINY_CHAT_TEMPLATE, "qwen3_5": QWEN3_5_TEMPLATE,
             "nemotron3": NEMOTRON3_TEMPLATE, "hermes": HERMES_TEMPLATE}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1}},
        "required": ["city"], "additionalProperties": False}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2, '
                     '"opts": {"a": [1, true]}, "flag": false}'}}
CHATS = {
    "plain": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}],
    "tool_loop": [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "13 C"},
        {"role": "assistant", "content": "It is mild.", "reasoning_content": "Both said ~12."},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Let me check.", "reasoning": "Call again.",
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"t\": 9}"}],
}


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["default", "nothink"])
@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["no_tools", "tools"])
@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_renders_as_transformers(name, chat, tools, kwargs):
    source = TEMPLATES[name]
    messages = template_messages(CHATS[chat])
    ours = ChatTemplate(source).render(messages, tools=tools, **kwargs)
    theirs, _ = chat_utils.render_jinja_template(
        conversations=[messages], tools=tools, chat_template=source,
        add_generation_prompt=True, **kwargs)
    assert ours == theirs[0]
    if tools:
        assert "get_weather" in ours
    if chat == "tool_loop":
        assert "<tool_response>\n12 C\n</tool_response>" in ours or "12 C" in ours
        assert "Oslo" in ours


def test_the_xml_call_format_renders_typed_arguments():
    messages = template_messages(CHATS["tool_loop"])
    text = ChatTemplate(QWEN3_5_TEMPLATE).render(messages, tools=[WEATHER])
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n<parameter=opts>\n{\"a\": [1, true]}\n"
            "</parameter>\n<parameter=flag>\nFalse\n</parameter>\n</function>\n</tool_call>"
            ) in text
    # both results of the first turn in one user turn; the newest reasoning is re-rendered
    assert ("<|im_start|>user\n<tool_response>\n12 C\n</tool_response>\n<tool_response>\n"
            "13 C\n</tool_response><|im_end|>") in text
    assert "<think>\nCall again.\n</think>\n\nLet me check." in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    nothink = ChatTemplate(QWEN3_5_TEMPLATE).render(messages, enable_thinking=False)
    assert nothink.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_hermes_calls_are_json():
    messages = template_messages(CHATS["tool_loop"])
    text = ChatTemplate(HERMES_TEMPLATE).render(messages, tools=[WEATHER])
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, '
            '"opts": {"a": [1, true]}, "flag": false}}\n</tool_call>') in text
    plain = ChatTemplate(HERMES_TEMPLATE).render(template_messages(CHATS["plain"]))
    assert plain == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                     "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nAgain"
                     "<|im_end|>\n<|im_start|>assistant\n")


def test_nemotron_truncates_history_thinking_and_lists_tools_as_xml():
    messages = template_messages(CHATS["tool_loop"])
    text = ChatTemplate(NEMOTRON3_TEMPLATE).render(messages, tools=[WEATHER])
    assert "Both said" not in text  # before the last user turn
    assert "<think>\nCall again.\n</think>\nLet me check." in text
    assert "<parameter>\n<name>unit</name>\n<type>string</type>\n<enum>[\"c\", \"f\"]</enum>" \
        in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    kept = ChatTemplate(NEMOTRON3_TEMPLATE).render(messages, truncate_history_thinking=False)
    assert "Both said ~12." in kept


def test_the_tiny_template_renders_plain_chats_as_before():
    messages = template_messages(CHATS["plain"])
    assert ChatTemplate(TINY_CHAT_TEMPLATE).render(messages) == (
        "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.\n<|user|>\nAgain\n"
        "<|assistant|>\n")


def test_a_templates_raise_exception_is_an_invalid_request_naming_its_message():
    with pytest.raises(InvalidRequestError, match="System message must be at the beginning"):
        ChatTemplate(QWEN3_5_TEMPLATE).render(template_messages(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]))
    with pytest.raises(InvalidRequestError, match="No user query found in messages"):
        ChatTemplate(QWEN3_5_TEMPLATE).render(template_messages(
            [{"role": "system", "content": "b"}]))


def test_malformed_tool_arguments_name_the_message_index():
    bad = [{"role": "user", "content": "x"},
           {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
               "name": "f", "arguments": "{\"a\": "}}]}]
    with pytest.raises(InvalidRequestError,
                       match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid"):
        template_messages(bad)
    bad[1]["tool_calls"][0]["function"]["arguments"] = "[1]"
    with pytest.raises(InvalidRequestError, match=r"messages\[1\].*must be a JSON object"):
        template_messages(bad)
