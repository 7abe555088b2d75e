"""Agents against a real cluster (router, 1 prefill, 1 decode worker; the tiny model with its
tokenizer.json), with the official openai client: `chat.completions.parse` with pydantic models
gives a parsed object every time (greedy and sampled, streamed and not), and greedy
constrained tokens through 1P+1D equal the colocated engine's (the prefill worker draws the
first token under the grammar, the decode worker replays it into its own matcher); required and
named tool_choice give calls that validate, whose streamed deltas reassemble to the whole
answer."""

from __future__ import annotations

import enum
import json
from pathlib import Path

import openai
import pydantic
import pytest

from baton.client.local import run_local
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.model.chat_template import TINY_CHAT_TEMPLATE, load_chat_template
from baton.model.tokenizer import load_tokenizer
from router.http.constraints import chat_grammar
from router.http.schemas import ChatCompletionRequest
from tests.integration.cluster_helpers import assert_clean, start_cluster, write_config
from tests.support.engine_helpers import make_checkpoint

pytestmark = pytest.mark.integration

CONFIG = {
    "cache": {"num_blocks": 512, "num_state_slots": 64, "mamba_state_config": {
        "periodic_snapshot_interval": 32, "additional_snapshot_offsets_from_end": [0],
        "decode_end_snapshot": True}},
    "router": {"policy": "session", "eject_after_seconds": 10.0, "heartbeat_seconds": 0.5},
    "worker": {"max_num_seqs": 16, "max_model_len": 2048},
    "transfer": {"lease_seconds": 120.0},
}


class Kind(str, enum.Enum):
    book = "book"
    film = "film"


class Tag(pydantic.BaseModel):
    label: str = pydantic.Field(max_length=6)
    weight: int = pydantic.Field(ge=0, le=9)


class Review(pydantic.BaseModel):
    kind: Kind
    title: str = pydantic.Field(max_length=8)
    tags: list[Tag] = pydantic.Field(max_length=2)
    stars: int | None = pydantic.Field(ge=1, le=5)
    liked: bool


TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 8},
                                     "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["query", "limit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "clock", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}}]
MESSAGES = [{"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": "Review a book."}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    model = make_checkpoint(root, tokenizer=True)  # folder "tiny": the served model name
    # the tiny template, ending an assistant turn with the EOS token the model ends it with (as
    # Qwen's <|im_end|> and Nemotron's do), so a turn's tokens are a prefix of the next prompt
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TINY_CHAT_TEMPLATE.replace(
        "{% endfor %}{{ '\\n' }}{% endfor %}",
        "{% endfor %}{% if message.role == 'assistant' %}{{ eos_token }}{% endif %}"
        "{{ '\\n' }}{% endfor %}")
    assert cfg["chat_template"] != TINY_CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    cluster = start_cluster(model, write_config(root / "baton.yaml", CONFIG), prefill=1, decode=1)
    client = openai.OpenAI(base_url=f"{cluster.http_address}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    engine = build_engine(BatonConfig.from_dict(CONFIG), str(model))
    yield {"cluster": cluster, "client": client, "model": model, "engine": engine}
    cluster.stop()


def local_tokens(setup, body: dict, max_tokens: int) -> list[int]:
    """The colocated engine's greedy answer to the same chat body (same prompt, same
    grammar as the router builds)."""
    req = ChatCompletionRequest.model_validate({"model": "tiny", **body})
    template = load_chat_template(setup["model"])
    tok = load_tokenizer(setup["model"])
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
    text = template.render([m.for_template() for m in req.messages], tools=tools)
    grammar, _, _ = chat_grammar(req, template.call_format, tools, False)
    spec = RequestSpec("local", prompt_ids=tok.encode(text),
                       sampling=SamplingParams(max_tokens=max_tokens, grammar=grammar))
    (out,) = run_local(setup["engine"], [spec])
    return out["token_ids"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11},
                                      {"temperature": 0.7, "top_p": 0.9, "seed": 12}],
                         ids=["greedy", "seeded", "top_p"])
def test_parse_gives_the_pydantic_object_whole_and_streamed(setup, sampling):
    client = setup["client"]
    out = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Review,
                                        max_tokens=300, extra_body={"return_token_ids": True},
                                        **sampling)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Review)
    if not sampling["temperature"]:  # greedy: exactly the colocated engine's tokens
        body = {"messages": MESSAGES, "response_format": {
            "type": "json_schema", "json_schema": {
                "name": "Review", "strict": True,
                "schema": openai.lib._pydantic.to_strict_json_schema(Review)}}}
        ids = choice.model_extra["token_ids"]
        assert ids == local_tokens(setup, body, 300)
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, response_format=Review,
                                        max_tokens=300, **sampling) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.parsed == choice.message.parsed


def test_n_samples_each_parse(setup):
    out = setup["client"].chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Review, max_tokens=300, n=3,
        temperature=1.0, seed=3)
    assert len(out.choices) == 3
    assert all(isinstance(c.message.parsed, Review) for c in out.choices)


def test_json_object_and_structured_outputs(setup):
    client = setup["client"]
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60,
                                         response_format={"type": "json_object"})
    choice = out.choices[0]
    if choice.finish_reason == "stop":  # an object the model closed within max_tokens
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # a grammar that cannot end within max_tokens: what was produced, "length"
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20,
                                         extra_body={"structured_outputs": {
                                             "choice": ["alpha", "beta"]}})
    assert out.choices[0].message.content in ("alpha", "beta")
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20,
                                         extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert len(out.choices[0].message.content) == 6


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def _valid(name: str, args: dict) -> bool:
    if name == "search":
        return set(args) == {"query", "limit"} and len(args["query"]) <= 8 and \
            1 <= args["limit"] <= 9
    return args in ({"zone": "utc"}, {"zone": "cet"})


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "clock"}}],
                         ids=["required", "named"])
def test_tool_choice_calls_validate_and_stream_to_the_same_answer(setup, choice):
    client = setup["client"]
    kw = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
          "max_tokens": 1200, "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls = _calls(whole.message)
    assert calls and all(_valid(n, a) for n, a in calls), calls
    if isinstance(choice, dict):
        assert [n for n, _ in calls] == ["clock"]
    with client.chat.completions.stream(**kw) as s:
        streamed = s.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and _calls(streamed.message) == calls
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert len(one.message.tool_calls) == 1


def test_an_agent_loop_over_the_responses_api_reuses_earlier_turns(setup):
    """Tool-call turns chained by previous_response_id: each runs on the conversation's decode
    worker and starts with the previous turn's own tokens, prompt and answer, all of them
    served from the cache (the decode-end snapshot)."""
    client = setup["client"]
    rtools = [{"type": "function", **t["function"]} for t in TOOLS]
    prev, seen = None, []
    for turn in range(4):
        inp = "Find a book." if prev is None else [
            {"type": "function_call_output", "call_id": c.call_id, "output": f"result {turn}"}
            for c in prev.output if c.type == "function_call"]
        r = client.responses.create(model="tiny", input=inp, tools=rtools,
                                    tool_choice="required", parallel_tool_calls=False,
                                    temperature=0, max_output_tokens=200,
                                    previous_response_id=prev.id if prev else None)
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1
        assert _valid(calls[0].name, json.loads(calls[0].arguments))
        seen.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens,
                     r.usage.output_tokens))
        prev = r
    for (before, _, out), (_, cached, _) in zip(seen, seen[1:], strict=False):
        assert cached == before + out, seen
    assert_clean(setup["cluster"])


def test_bad_constraints_are_400s_naming_the_field(setup):
    client = setup["client"]
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/no"}}}}}},
         "response_format.json_schema.schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: missing_rule"}}},
         "structured_outputs.grammar"),
        ({"response_format": {"type": "json_object"}, "tools": TOOLS,
          "tool_choice": "required"}, "response_format"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **kw)
        assert e.value.body["param"] == param, (param, e.value.body)
    assert_clean(setup["cluster"])


def test_the_router_serves_constraints_without_torch(setup):
    """The router builds and checks grammars without torch (which only the workers' masks
    need): a start of it costs no torch import (about 2 s of CPU; every cluster starts one)."""
    router = setup["cluster"].procs[0]
    assert "router" in router.args
    client = setup["client"]
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                   response_format={"type": "json_object"})
    maps = Path(f"/proc/{router.pid}/maps").read_text()
    assert "libtorch" not in maps
