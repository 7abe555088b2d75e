"""Constrained decoding on the engine (llguidance): every answer follows its grammar (a JSON
schema with every bound, tool calls in the model's own format, regex, choice), greedy and
sampled, each of n samples on its own matcher, on the tiny model with its tokenizer.json and
with the byte-level fallback; bad grammars are refused by name; speculation drafts for a
constrained request and equals speculation off."""

from __future__ import annotations

import enum
import json
import re

import pydantic
import pytest
import torch

from baton.agents import grammar as g
from baton.agents.parse import OutputParser, OutputSpec
from baton.engine.request import Request, SamplingParams
from baton.errors import InvalidRequestError
from baton.model.tokenizer import load_tokenizer
from tests.support.engine_helpers import engine_for, make_checkpoint, run_all

openai_pydantic = pytest.importorskip("openai.lib._pydantic")


class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Item(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    qty: int = pydantic.Field(ge=0, le=99)


class Order(pydantic.BaseModel):
    color: Color
    items: list[Item] = pydantic.Field(max_length=2)
    note: str | None = pydantic.Field(max_length=5)
    ok: bool


SCHEMA = openai_pydantic.to_strict_json_schema(Order)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 4},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {
        "type": "object", "properties": {}}}}]


@pytest.fixture(scope="module", params=[True, False], ids=["tokenizer_json", "bytes"])
def setup(request, tmp_path_factory):
    ck = make_checkpoint(tmp_path_factory.mktemp("g"), tokenizer=request.param)
    return engine_for(ck), load_tokenizer(ck)


def run(setup, grammar: str, samplings: list[dict], prompt: str = "Answer:",
        max_tokens: int = 200) -> list[str]:
    eng, tok = setup
    reqs = [Request(f"r{i}", tok.encode(prompt), SamplingParams(
        max_tokens=max_tokens, grammar=grammar, **s)) for i, s in enumerate(samplings)]
    out = run_all(eng, reqs)
    assert eng.requests == {} and eng.tracked()["grammar_matchers"] == 0
    texts = []
    for r in reqs:
        ids = out["tokens"][r.id]
        assert out["outputs"][r.id].finish_reason == "stop", tok.decode(ids)
        assert ids[-1] in eng.eos_ids
        texts.append(tok.decode(ids[:-1]))
    return texts


SAMPLINGS = [{}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2},
             {"temperature": 0.8, "top_p": 0.9, "seed": 3}]


def test_json_schema_answers_validate_greedy_and_sampled(setup):
    grammar = g.compile_text("start: " + g.json_lark(SCHEMA), "response_format")
    for text in run(setup, grammar, SAMPLINGS):
        Order.model_validate_json(text)
        assert ": " not in text and ", " not in text.replace('", "', "")  # compact


def test_each_of_n_samples_follows_the_grammar(setup):
    eng, tok = setup
    grammar = g.compile_text("start: " + g.json_lark(SCHEMA), "response_format")
    req = Request("n", tok.encode("Answer:"), SamplingParams(
        max_tokens=200, grammar=grammar, n=3, temperature=1.0, seed=5))
    eng.add_request(req)
    outs: dict[int, list[int]] = {}
    done = set()
    while len(done) < 3:
        for o in eng.step():
            outs.setdefault(o.sample, []).extend(o.new_token_ids)
            if o.finished:
                done.add(o.sample)
    for ids in outs.values():
        Order.model_validate_json(tok.decode(ids[:-1]))
    assert eng.tracked()["grammar_matchers"] == 0


@pytest.mark.parametrize("one", [True, False], ids=["one", "parallel"])
@pytest.mark.parametrize("fmt", ["xml", "hermes"])
def test_required_tool_calls_parse_and_validate(setup, fmt, one):
    grammar = g.compile_text(g.calls_lark(TOOLS, fmt, one=one, flexible=False), "tool_choice")
    for text in run(setup, grammar, SAMPLINGS[:3], max_tokens=1000):
        p = OutputParser(OutputSpec(fmt, TOOLS))
        p.feed(text, final=True)
        msg = p.message()
        assert 1 <= len(msg["tool_calls"]) <= (1 if one else g.MAX_CALLS), text
        for call in msg["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "lookup":
                assert set(args) == {"city", "unit", "days"}, text
                assert len(args["city"]) <= 4 and args["unit"] in "cf" and 1 <= args["days"] <= 7
            else:
                assert args == {}


def test_the_mask_starts_when_reasoning_ends(setup):
    """Reasoning runs free up to `</think>`; then only the named call may follow (a random
    model never closes its reasoning, so the tokens are given here)."""
    eng, tok = setup
    grammar = g.compile_text(g.with_reasoning(g.calls_lark(TOOLS[:1], "xml", True, False)),
                             "tool_choice")

    class Req:
        id = "reasoning"
        sampling = SamplingParams(grammar=grammar)
        output_ids: list[int] = []

    req = Req()
    vocab = eng.model.config.vocab_size
    logits = torch.zeros(1, vocab)
    for text, free in (("", True), ("Let me see <b>", True),
                       ("Let me see <b></think>\n\n", False)):
        req.output_ids = tok.encode(text)
        masked, broken = eng.grammars.mask(logits, [req])
        allowed = torch.isfinite(masked[0])
        assert not broken
        if free:
            assert int(allowed.sum()) >= 128, text  # every ASCII byte at least
        else:
            first = {tok.decode([t]) for t in allowed.nonzero().flatten().tolist()}
            assert "<" in first and all(x == "\n" or "<tool_call>\n".startswith(x)
                                        for x in first), first
    eng.grammars.forget(req.id)
    assert eng.grammars.tracked == 0


def test_regex_and_choice(setup):
    from llguidance import LLMatcher

    lark = json.loads(LLMatcher.grammar_from_regex(r"[a-c]{2}-\d{3}"))["grammars"][0]
    text, = run(setup, g.compile_text(lark["lark_grammar"], "structured_outputs.regex"), [{}])
    assert re.fullmatch(r"[a-c]{2}-\d{3}", text)
    texts = run(setup, g.compile_text('start: "yes" | "no" | "maybe"', "choice"), SAMPLINGS)
    assert set(texts) <= {"yes", "no", "maybe"}


def test_bad_grammars_are_refused_by_field():
    with pytest.raises(InvalidRequestError, match=r"^response_format\.json_schema\.schema: "):
        g.compile_text("start: " + g.json_lark({"type": "object", "properties": {
            "x": {"$ref": "#/nope"}}}), "response_format.json_schema.schema")
    with pytest.raises(InvalidRequestError, match=r"^structured_outputs\.grammar: "):
        g.compile_text("start: nothing_here", "structured_outputs.grammar")


def test_compiles_once_per_grammar_and_counts_masks(setup):
    eng, _ = setup
    grammar = g.compile_text('start: "a" | "b"', "x")
    before = eng.grammars.compiles
    first = eng.grammars.prepare(grammar)
    assert eng.grammars.prepare(grammar) is first
    assert eng.grammars.compiles == before + 1
    masks, ahead = eng.grammars.masks, eng.grammars.masks_ahead
    run(setup, grammar, [{}])
    assert eng.grammars.masks == masks + 2 and eng.grammars.mask_seconds > 0
    # the first token's mask after the prefill, the second's computed during the decode forward
    assert eng.grammars.masks_ahead == ahead + 1


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    from tests.support.speculative_helpers import agreeing_checkpoint

    ck = agreeing_checkpoint(tmp_path_factory.mktemp("agree"))
    return ck, load_tokenizer(ck)


@pytest.mark.parametrize("spec", [{"num_draft_tokens": 3}, {"num_draft_tokens": 3, "tree": {
    "top_k": [3, 2, 2], "max_total_draft_tokens": 8}}], ids=["chain", "tree"])
def test_speculation_drafts_under_the_grammar_and_equals_off(agreeing, spec):
    """Constrained requests draft: each verify row is masked under the drafts before it and
    the matcher rolls back, so the tokens equal speculation off exactly, greedy and seeded,
    samples of n (each its own matcher), beside an unconstrained request; drafts were both
    accepted and rejected (a chain's drafts are drawn under the mask too: most are kept)."""
    ck, tok = agreeing
    grammar = g.compile_text("start: " + g.json_lark(SCHEMA), "response_format")
    calls = g.compile_text(g.calls_lark(TOOLS, "xml", one=False, flexible=False), "tool_choice")

    def answers(**spec):
        eng = engine_for(ck, worker={"max_num_seqs": 8}, cache={"num_state_slots": 128}, **spec)
        reqs = [Request("c", tok.encode("Q:"), SamplingParams(max_tokens=200, grammar=grammar)),
                Request("t", tok.encode("Call:"), SamplingParams(max_tokens=300,
                                                                 grammar=calls)),
                Request("s", tok.encode("Q:"), SamplingParams(
                    max_tokens=200, grammar=grammar, temperature=1.0, seed=7)),
                *(Request(f"n{i}", tok.encode("Q?"), SamplingParams(  # samples of n, as the
                    max_tokens=200, grammar=grammar, temperature=0.8, seed=3 + i))  # router
                  for i in range(2)),  # sends them to a speculating worker
                Request("f", tok.encode("Q:"), SamplingParams(max_tokens=24, ignore_eos=True))]
        samples: dict = {}
        for r in reqs:
            eng.add_request(r)
        done = 0
        while done < 6:
            for o in eng.step():
                samples.setdefault((o.request_id, o.sample), []).extend(o.new_token_ids)
                done += o.finished
        assert eng.requests == {} and eng.tracked()["grammar_matchers"] == 0
        return samples, {r.id: (r.draft_tokens, r.accepted_tokens) for r in reqs}

    off, _ = answers()
    on, drafts = answers(speculative=spec)
    assert on == off
    for rid in ("c", "t", "s"):  # constrained requests drafted, kept some, rejected some
        assert 0 < drafts[rid][1] < drafts[rid][0], drafts
        if "tree" not in spec:  # a chain's drafts are drawn under the mask: most are kept
            assert drafts[rid][1] > 0.8 * drafts[rid][0], drafts
    for key, ids in on.items():
        if key[0] != "f":
            text = tok.decode(ids[:-1])
            if key[0] == "t":
                assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
            else:
                Order.model_validate_json(text)


def test_worker_metrics_show_compile_and_mask_time(setup):
    from prometheus_client import generate_latest

    from baton.contract import Role
    from baton.engine.loop import EngineLoop
    from baton.worker.metrics import WorkerMetrics

    eng, _ = setup
    run(setup, g.compile_text('start: "x" | "y"', "x"), [{}])
    loop = EngineLoop(eng)
    try:
        text = generate_latest(WorkerMetrics(Role.DECODE, loop).registry).decode()
    finally:
        loop.stop()
    for name in ("compiles", "compile_seconds", "masks", "mask_seconds"):
        line = next(x for x in text.splitlines() if x.startswith(f"baton_grammar_{name}_total"))
        assert float(line.split()[-1]) > 0, line


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 3}])
def test_a_grammar_with_ignore_eos_or_min_tokens_is_refused(setup, extra):
    eng, tok = setup
    grammar = g.compile_text('start: "a"', "x")
    with pytest.raises(InvalidRequestError, match=f"^{next(iter(extra))}: a constrained"):
        eng.add_request(Request("bad", tok.encode("x"), SamplingParams(
            max_tokens=5, grammar=grammar, **extra)))
    assert eng.requests == {}


def test_grammars_compile_on_the_submitting_thread_never_the_engine_loops(setup):
    import queue
    import threading

    from baton.engine.loop import EngineLoop

    eng, tok = setup
    grammar = g.compile_text('start: "q" | "r" | "s"', "x")
    compiled_on: list[str] = []
    original = eng.grammars.prepare

    def prepare(text):
        before = eng.grammars.compiles
        out = original(text)
        if eng.grammars.compiles > before:
            compiled_on.append(threading.current_thread().name)
        return out

    eng.grammars.prepare = prepare
    loop = EngineLoop(eng)
    try:
        box: queue.Queue = queue.Queue()
        loop.submit(Request("t", tok.encode("x"), SamplingParams(max_tokens=5, grammar=grammar)),
                    box.put)
        while not box.get(timeout=60).finished:
            pass
    finally:
        loop.stop()
        eng.grammars.prepare = original
    assert compiled_on == [threading.current_thread().name]


def test_a_resumed_request_replays_the_tokens_sent_into_its_matcher(setup):
    """A request whose decode worker died goes on elsewhere as prompt + the tokens sent
    (router/failover.py `resumed`, with grammar_replay = their count): its matcher replays them
    first, and the answer goes on exactly as the uninterrupted one."""
    from baton.contract import GenerateInput
    from router.failover import resumed

    eng, tok = setup
    grammar = g.compile_text("start: " + g.json_lark(SCHEMA), "response_format")
    prompt = tok.encode("Answer:")
    whole = run_all(eng, [Request("w", prompt, SamplingParams(max_tokens=200,
                                                              grammar=grammar))])
    ids = whole["tokens"]["w"]
    inp = GenerateInput("w", tuple(prompt), None, SamplingParams(max_tokens=200, grammar=grammar))
    for cut in (1, 7):
        new_prompt, new_inp = resumed(inp, prompt, ids[:cut])
        assert new_inp.sampling.grammar_replay == cut
        rest = run_all(eng, [Request(f"r{cut}", list(new_prompt), new_inp.sampling)])
        assert ids[:cut] + rest["tokens"][f"r{cut}"] == ids
    assert eng.tracked()["grammar_matchers"] == 0


def test_a_replay_count_beyond_the_prompt_fails_that_request_alone(setup):
    """grammar_replay counts tokens at the end of the prompt: one larger than the prompt (a
    malformed resume) fails its own request with the reason, never replays from a wrapped
    slice, and the request beside it finishes exactly as it would alone."""
    eng, tok = setup
    grammar = g.compile_text("start: " + g.json_lark(SCHEMA), "response_format")
    prompt = tok.encode("Answer:")
    alone = run_all(eng, [Request("ok", prompt, SamplingParams(max_tokens=40, grammar=grammar))])
    both = run_all(eng, [
        Request("ok2", prompt, SamplingParams(max_tokens=40, grammar=grammar)),
        Request("bad", prompt, SamplingParams(max_tokens=40, grammar=grammar,
                                              grammar_replay=len(prompt) + 2))])
    assert both["tokens"]["ok2"] == alone["tokens"]["ok"]
    assert both["tokens"]["bad"] == []
    assert "exceeds its" in str(both["outputs"]["bad"].error)
    assert eng.tracked()["grammar_matchers"] == 0


def _accepts(grammars, grammar: str, tok, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there."""
    m = grammars.prepare(grammar).deep_copy()
    ids = tok.encode(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("fmt", ["xml", "hermes"])
def test_auto_with_strict_tools_is_free_text_or_valid_calls(setup, fmt):
    """`tool_choice: "auto"` with a strict tool: free text without a call tag, or calls (after
    free text, or none) whose arguments follow the schema; `parallel_tool_calls: false`: one."""
    eng, tok = setup
    xml = {"ok": "<tool_call>\n<function=lookup>\n<parameter=city>\nRome\n</parameter>\n"
                 "<parameter=unit>\nc\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
                 "</function>\n</tool_call>",
           "bad": "<tool_call>\n<function=lookup>\n<parameter=city>\nRome\n</parameter>\n"
                  "<parameter=unit>\nc\n</parameter>\n<parameter=days>\n9\n</parameter>\n"
                  "</function>\n</tool_call>"}
    hermes = {"ok": '<tool_call>\n{"name":"lookup","arguments":{"city":"Rome","unit":"c",'
                    '"days":3}}\n</tool_call>',
              "bad": '<tool_call>\n{"name":"lookup","arguments":{"city":"Rome","unit":"k",'
                     '"days":3}}\n</tool_call>'}
    call = xml if fmt == "xml" else hermes
    tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
    many = g.compile_text(g.calls_lark(tools, fmt, False, False, free=True), "tools")
    one = g.compile_text(g.calls_lark(tools, fmt, True, False, free=True), "tools")
    grammars = eng.grammars
    for text in ("", "Sunny.", "a < b <tool", call["ok"], "Let me look.\n\n" + call["ok"],
                 call["ok"] + "\n" + call["ok"]):
        assert _accepts(grammars, many, tok, text), text
    for text in (call["bad"], "x " + call["bad"], call["ok"] + " then text",
                 "<tool_call>\nnot a call</tool_call>"):
        assert not _accepts(grammars, many, tok, text), text
    assert _accepts(grammars, one, tok, call["ok"])
    assert not _accepts(grammars, one, tok, call["ok"] + "\n" + call["ok"])
    reqs = [Request(f"a{i}", tok.encode("Answer:"), SamplingParams(
        max_tokens=60, grammar=many, **s)) for i, s in enumerate(SAMPLINGS[:2])]
    out = run_all(eng, reqs)  # the random model writes text (to the length limit) under it
    for r in reqs:
        assert out["outputs"][r.id].finish_reason in ("stop", "length")
        assert _accepts(grammars, many, tok, tok.decode(
            [t for t in out["tokens"][r.id] if t not in eng.eos_ids])) or \
            out["outputs"][r.id].finish_reason == "length"
    assert eng.tracked()["grammar_matchers"] == 0
