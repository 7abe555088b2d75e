"""The HTTP API over a scripted orchestrator: what reaches the orchestrator, error statuses,
stop strings, streaming errors and cancellation on disconnect (real uvicorn, no workers)."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from baton.config.router import RouterConfig
from baton.contract import FinishReason, GenerateChunk, GenerateSummary, SamplingParams
from baton.errors import (
    CapacityError,
    InvalidRequestError,
    NoWorkersError,
    RequestCancelled,
    WorkerFailed,
)
from baton.model.chat_template import TINY_CHAT_TEMPLATE, ChatTemplate, load_chat_template
from baton.model.tokenizer import ByteTokenizer
from router.http.app import HttpContext
from router.http.server import HttpServer
from router.http.stops import StopStrings
from router.metrics import RouterMetrics
from router.registry import Registry


class ScriptedOrchestrator:
    """`generate` replays `script(inp, cancel)`; every call is kept in `calls`."""

    def __init__(self):
        self.config = RouterConfig()
        self.registry = Registry(5.0)
        self.tokenizer = ByteTokenizer()
        self.script = lambda inp, cancel: iter(())
        self.calls = []

    def generate(self, inp, cancel):
        self.calls.append((inp, cancel))
        yield from self.script(inp, cancel)


@pytest.fixture(scope="module")
def api():
    orch = ScriptedOrchestrator()
    ctx = HttpContext(orch, RouterMetrics(orch.registry), "tiny", ChatTemplate(TINY_CHAT_TEMPLATE),
                      max_model_len=64, max_body_bytes=4096, pool=ThreadPoolExecutor(8))
    server = HttpServer(ctx, "127.0.0.1", 0)
    yield orch, ctx, server.port
    server.stop()


def summary(reason=FinishReason.LENGTH, prompt_tokens=3) -> GenerateSummary:
    return GenerateSummary(reason, prompt_tokens, 0, "p0", "d0", 1.0, 2.0, 0)


def chunks(*texts, reason=FinishReason.LENGTH):
    """One chunk a text (token id = its position + 10); the last one finishes."""
    out = [GenerateChunk("r", (10 + i,), t) for i, t in enumerate(texts)]
    last = out[-1]
    out[-1] = GenerateChunk("r", last.token_ids, last.text, summary(reason))
    return out


def request(port, path, body, method="POST") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    data = body if isinstance(body, bytes | None) else json.dumps(body)
    conn.request(method, path, data, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def sse(raw: bytes) -> list:
    return [json.loads(x[6:]) if x != b"data: [DONE]" else "[DONE]"
            for x in raw.split(b"\n\n") if x.startswith(b"data: ")]


def requests_total(ctx, outcome: str) -> float:
    return ctx.metrics.registry.get_sample_value(
        "baton_router_requests_total", {"api": "http", "outcome": outcome}) or 0.0


def wait_for(predicate, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_sampling_prompt_and_session_reach_the_orchestrator(api):
    orch, _, port = api
    orch.script = lambda inp, cancel: iter(chunks("x"))
    body = {"model": "tiny", "prompt": "hey", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9,
            "seed": 7, "top_k": 3, "stop_token_ids": [9], "session_id": "s1"}
    status, _ = request(port, "/v1/completions", body)
    inp = orch.calls[-1][0]
    assert status == 200
    assert inp.prompt_ids == tuple(ByteTokenizer().encode("hey")) and inp.prompt_text is None
    assert inp.sampling == SamplingParams(4, 0.5, 0.9, 3, 7, (9,), False)
    assert inp.session_id == "s1" and inp.request_id.startswith("cmpl-")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    status, _ = request(port, "/v1/chat/completions", chat)
    inp = orch.calls[-1][0]
    rendered = ByteTokenizer().encode("<|user|>\nhi\n<|assistant|>\n")
    assert inp.prompt_ids == tuple(rendered)
    # OpenAI's defaults: temperature 1; chat answers may fill the context
    assert inp.sampling == SamplingParams(max_tokens=64 - len(rendered), temperature=1.0)


@pytest.mark.parametrize("exc, status, kind, param", [
    (CapacityError("decode worker is full (32 requests)"), 429, "rate_limit_error", None),
    (NoWorkersError("no prefill worker available"), 503, "service_unavailable", None),
    (WorkerFailed("d0", "Reserve", "UNAVAILABLE"), 503, "service_unavailable", None),
    (InvalidRequestError("max_tokens must be an integer >= 1"), 400, "invalid_request_error",
     "max_tokens"),
    (RuntimeError("a bug"), 500, "server_error", None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_errors_behind_the_api_keep_their_status(api, exc, status, kind, param, stream):
    orch, _, port = api

    def fail(inp, cancel):
        raise exc
        yield

    orch.script = fail
    body = {"model": "tiny", "prompt": [5], "stream": stream}
    code, raw = request(port, "/v1/completions", body)
    assert code == status
    err = json.loads(raw)["error"]
    assert (err["type"], err["param"]) == (kind, param) and str(exc) in err["message"]


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event(api):
    orch, _, port = api

    def fail_mid(inp, cancel):
        yield GenerateChunk("r", (10,), "a")
        raise WorkerFailed("d0", "Decode", "UNAVAILABLE: gone")

    orch.script = fail_mid
    code, raw = request(port, "/v1/completions", {"model": "tiny", "prompt": [5], "stream": True})
    events = sse(raw)
    assert code == 200 and len(events) == 3 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["text"] == "a"
    assert events[1]["error"]["type"] == "service_unavailable"
    assert "worker d0 failed Decode" in events[1]["error"]["message"]


def _blocks_until_cancelled(first):
    def script(inp, cancel):
        yield from first
        assert wait_for(lambda: cancel.cancelled, 10)
        raise RequestCancelled("cancelled")
    return script


def test_a_stop_string_split_across_chunks_ends_the_answer_and_the_request(api):
    orch, ctx, port = api
    before = requests_total(ctx, "stop")
    orch.script = _blocks_until_cancelled(chunks("ab", "cS", "TO", "Pd", "never")[:4])
    body = {"model": "tiny", "prompt": [5], "stream": True, "stop": ["STOP", "zz"],
            "return_token_ids": True}
    code, raw = request(port, "/v1/completions", body)
    events = sse(raw)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "abc"
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == [10, 11, 12, 13]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert orch.calls[-1][1].cancelled
    assert wait_for(lambda: requests_total(ctx, "stop") == before + 1)
    orch.script = lambda inp, cancel: iter(chunks("ab", "cST", "OPd"))
    body = {"model": "tiny", "prompt": [5], "stop": "STOP"}
    code, raw = request(port, "/v1/completions", body)
    reply = json.loads(raw)
    assert (reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]) == ("abc", "stop")
    assert reply["usage"]["completion_tokens"] == 3


def _stops_then_summarises(first):
    """As the orchestrator does when the answer is stopped: the stream ends with a STOP summary
    (6 cached prompt tokens, served by p0 and d0)."""
    def script(inp, cancel):
        yield from first
        assert wait_for(lambda: cancel.cancelled, 10) and cancel.stopped
        s = GenerateSummary(FinishReason.STOP, 9, 6, "p0", "d0", 1.0, 2.0, 0)
        yield GenerateChunk("r", (), "", s)
    return script


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_inside_a_chunk_of_several_tokens_keeps_the_summary(api, stream):
    """The stop string completes at the 4th token of a 7-token chunk (one with no text after
    it): the answer keeps tokens through that one, and reports the summary the stopped request
    still ends with, counted once as `stop`."""
    orch, ctx, port = api
    enc = ByteTokenizer().encode
    before = requests_total(ctx, "stop")
    second = enc("cSTOP") + [300] + enc("de")  # 300 decodes to no text
    orch.script = _stops_then_summarises([GenerateChunk("r", tuple(enc("ab")), "ab"),
                                          GenerateChunk("r", tuple(second), "cSTOPde")])
    body = {"model": "tiny", "prompt": [5] * 9, "stream": stream, "stop": ["STOP", "xy"],
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    if not stream:
        del body["stream_options"]
    code, raw = request(port, "/v1/completions", body)
    assert code == 200
    if stream:
        *events, usage_event, done = sse(raw)
        assert done == "[DONE]" and usage_event["choices"] == []
        usage, last = usage_event["usage"], events[-1]
        n = len(events)  # 1 or 2: the chunks may arrive together
        assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (n - 1) + ["stop"]
        assert ["baton" in e for e in events] == [False] * (n - 1) + [True]
        text = "".join(e["choices"][0]["text"] for e in events)
        ids = [t for e in events for t in e["choices"][0]["token_ids"]]
    else:
        last = json.loads(raw)
        (choice,) = last["choices"]
        usage, text, ids = last["usage"], choice["text"], choice["token_ids"]
        assert choice["finish_reason"] == "stop"
    assert text == "abc" and ids == enc("abcSTOP")
    assert usage == {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16,
                     "prompt_tokens_details": {"cached_tokens": 6}}
    assert last["baton"] == {"session_id": None, "cached_tokens": 6, "prefill_worker": "p0",
                             "decode_worker": "d0", "retries": 0, "ttft_ms": 1.0}
    assert orch.calls[-1][1].stopped
    assert wait_for(lambda: requests_total(ctx, "stop") == before + 1)
    time.sleep(0.05)
    assert requests_total(ctx, "stop") == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_whose_text_comes_a_chunk_late_ends_the_answer_at_its_token(api, stream):
    """The worker holds a chunk's text while it ends in a character cut in two: the chunk that
    completes `STOP` also starts an emoji, and its text comes with the next chunk. The answer
    still ends at the token that completed the stop string; no later token is sent."""
    orch, ctx, port = api
    enc = ByteTokenizer().encode
    emoji = enc("\U0001F600")
    orch.script = _stops_then_summarises([
        GenerateChunk("r", tuple(enc("ab")), "ab"),
        GenerateChunk("r", (*enc("STOP"), emoji[0]), ""),
        GenerateChunk("r", (*emoji[1:], *enc("x")), "STOP\U0001F600x")])
    body = {"model": "tiny", "prompt": [5] * 9, "stream": stream, "stop": ["STOP"],
            "return_token_ids": True}
    code, raw = request(port, "/v1/completions", body)
    assert code == 200
    if stream:
        events = sse(raw)[:-1]
        text = "".join(e["choices"][0]["text"] for e in events)
        ids = [t for e in events for t in e["choices"][0]["token_ids"]]
        finish, usage = events[-1]["choices"][0]["finish_reason"], None
    else:
        reply = json.loads(raw)
        (choice,) = reply["choices"]
        text, ids, finish = choice["text"], choice["token_ids"], choice["finish_reason"]
        usage = reply["usage"]["completion_tokens"]
    assert (text, ids, finish) == ("ab", enc("abSTOP"), "stop")
    assert usage in (None, 6)


def test_the_first_stop_string_to_complete_ends_the_answer():
    """As if checked token by token, however the text is chunked: `cd` completes before
    `abcdef` does, so the answer is `ab` and the text through the stop is `abcd`."""
    for pieces in (["abcdef"], ["a", "b", "c", "d", "e", "f"], ["xabc", "def"]):
        s = StopStrings(["abcdef", "cd"])
        out, hit = "", False
        for p in pieces:
            released = out
            text, hit = s.feed(p)
            out += text
            if hit:
                break
        assert (out.removeprefix("x"), hit) == ("ab", True), pieces
        fed = "".join(pieces)
        assert released + s.through_stop == fed[: fed.index("cd") + 2]  # fed through the stop
    s = StopStrings(["cd"])
    assert s.feed("xc") == ("x", False)
    assert s.feed("dy") == ("", True) and s.through_stop == "cd"


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(api, stream):
    orch, ctx, port = api
    before = requests_total(ctx, "cancelled")
    orch.script = _blocks_until_cancelled([GenerateChunk("r", (10,), "a")] if stream else [])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("POST", "/v1/completions",
                 json.dumps({"model": "tiny", "prompt": [5], "stream": stream}))
    if stream:
        assert conn.getresponse().readline().startswith(b"data: {")
    else:
        assert wait_for(lambda: orch.calls and not orch.calls[-1][1].cancelled)
    conn.sock.close()
    conn.close()
    assert wait_for(lambda: orch.calls[-1][1].cancelled, 10)
    assert wait_for(lambda: requests_total(ctx, "cancelled") == before + 1)


def test_health_is_not_ready_without_workers_and_unknown_paths_get_openai_errors(api):
    _, _, port = api
    code, raw = request(port, "/health", None, "GET")
    assert (code, json.loads(raw)) == (
        503, {"status": "not ready", "prefill_workers": 0, "decode_workers": 0})
    code, raw = request(port, "/v1/nothing", {})
    assert code == 404 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_body_limit_and_refusals_name_the_field(api):
    _, _, port = api
    code, raw = request(port, "/v1/completions", {"model": "tiny", "prompt": "x" * 5000})
    assert code == 413 and json.loads(raw)["error"]["code"] == "body_too_large"
    cases = [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
          "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                     {"type": "input_audio"}]}]},
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0].function"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
         "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"messages": [{"role": "user", "content": "x"}], "stream_options": {
            "include_usage": True}}, "stream_options"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_k": 2**40}, "top_k"),
    ]
    for body, param in cases:
        code, raw = request(port, "/v1/chat/completions", {"model": "tiny", **body})
        assert (code, json.loads(raw)["error"]["param"]) == (400, param), body
    # values the wire to the workers cannot carry are refused here, never a 500
    for prompt in ([5, 2**40], [-1]):
        code, raw = request(port, "/v1/completions", {"model": "tiny", "prompt": prompt})
        assert (code, json.loads(raw)["error"]["param"]) == (400, "prompt")


def test_stop_strings_hold_back_only_what_may_start_a_stop():
    s = StopStrings(["</s>", "END"])
    assert s.feed("hello <") == ("hello ", False)
    assert s.feed("/") == ("", False)
    assert s.feed("x E") == ("</x ", False)
    assert s.feed("ND tail") == ("", True)
    s = StopStrings(["ab"])
    assert s.feed("xa") == ("x", False)
    assert s.flush() == "a"
    assert StopStrings([]).feed("anything") == ("anything", False)


def test_chat_template_from_tokenizer_config(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{% for m in messages %}"
                           "[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"},
                          {"name": "tool_use", "template": "unused"}],
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    t = load_chat_template(tmp_path)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert t.render(msgs) == "<s>[user]a</s>[assistant]b</s>"
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError, match="messages: .*roles must alternate"):
        refusing.render(msgs)


def test_the_listening_socket_is_tcp_so_asyncio_turns_nagle_off():
    """asyncio sets TCP_NODELAY only on connections of a socket made with IPPROTO_TCP; without
    it each streamed token waits for the client's delayed ACK (~40 ms)."""
    import socket

    from router.http.server import _bind

    sock = _bind("127.0.0.1", 0)
    try:
        assert (sock.family, sock.type, sock.proto) == (
            socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    finally:
        sock.close()


def test_api_keys_guard_the_v1_api_but_not_health_or_metrics():
    orch = ScriptedOrchestrator()
    orch.script = lambda inp, cancel: iter(chunks("a", "b"))
    ctx = HttpContext(orch, RouterMetrics(orch.registry), "tiny", ChatTemplate(TINY_CHAT_TEMPLATE),
                      max_model_len=64, max_body_bytes=4096, pool=ThreadPoolExecutor(2),
                      api_keys=frozenset({"k-123"}))
    server = HttpServer(ctx, "127.0.0.1", 0)
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        status, raw = request(server.port, "/v1/completions", body)
        err = json.loads(raw)["error"]
        assert (status, err["type"], err["code"]) == (401, "authentication_error",
                                                      "invalid_api_key")
        assert orch.calls == []  # refused before anything reached the router's core
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json", "Authorization": "Bearer k-123"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["choices"][0]["text"] == "ab"
        conn.close()
        assert len(orch.calls) == 1
        assert request(server.port, "/metrics", None, "GET")[0] == 200
        assert request(server.port, "/health", None, "GET")[0] == 503  # open; no workers
    finally:
        server.stop()
