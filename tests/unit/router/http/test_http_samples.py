"""`n` over the HTTP API with a scripted orchestrator: one request a prompt carries the n
samples, each choice reads its own sample, stops alone and fails alone."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from baton.contract import FinishReason, GenerateChunk
from baton.errors import WorkerFailed
from baton.model.chat_template import TINY_CHAT_TEMPLATE, ChatTemplate
from router.http.app import HttpContext
from router.http.server import HttpServer
from router.metrics import RouterMetrics
from tests.unit.router.http.test_http_frontend import ScriptedOrchestrator, request, sse, summary


@pytest.fixture(scope="module")
def api():
    orch = ScriptedOrchestrator()
    ctx = HttpContext(orch, RouterMetrics(orch.registry), "tiny", ChatTemplate(TINY_CHAT_TEMPLATE),
                      max_model_len=64, max_body_bytes=4096, pool=ThreadPoolExecutor(4))
    server = HttpServer(ctx, "127.0.0.1", 0)
    yield orch, server.port
    server.stop()


def chunk(sample: int, text: str, reason: FinishReason | None = None) -> GenerateChunk:
    return GenerateChunk("r", (ord(text[0]),) if text else (), text,
                         summary(reason) if reason else None, sample=sample)


BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 3, "seed": 5, "temperature": 1}


def test_one_request_carries_the_samples_and_each_choice_gets_its_own(api):
    orch, port = api
    orch.script = lambda inp, cancel: iter([
        chunk(1, "b"), chunk(0, "a"), chunk(2, "c"), chunk(1, "B", FinishReason.STOP),
        chunk(0, "A", FinishReason.LENGTH), chunk(2, "C", FinishReason.LENGTH)])
    status, raw = request(port, "/v1/completions", BODY)
    assert status == 200
    (inp, _), = orch.calls[-1:]
    assert (inp.sampling.n, inp.sampling.seed) == (3, 5) and len(orch.calls) == 1
    r = json.loads(raw)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in r["choices"]] == [
        (0, "aA", "length"), (1, "bB", "stop"), (2, "cC", "length")]
    usage = r["usage"]  # the prompt ("hi", 2 bytes) once, every sample's tokens
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 6)


def test_a_stop_string_stops_its_sample_alone(api):
    orch, port = api
    orch.calls.clear()

    def script(inp, cancel):
        yield chunk(0, "x")
        yield chunk(1, "y")
        yield chunk(2, "c")  # every sample's first token comes at once
        yield chunk(1, "S")  # choice 1's stop string
        for _ in range(200):
            if cancel.stopped_samples:
                break
            time.sleep(0.01)
        assert cancel.stopped_samples == {1} and not cancel.cancelled
        yield chunk(1, "", FinishReason.STOP)  # the router's summary of the stopped sample
        yield chunk(0, "z", FinishReason.LENGTH)
        yield chunk(2, "w", FinishReason.LENGTH)

    orch.script = script
    for stream in (False, True):
        status, raw = request(port, "/v1/completions", {**BODY, "stop": "S", "stream": stream})
        assert status == 200
        texts: dict[int, str] = {}
        for c in (sse(raw)[:-1] if stream else [json.loads(raw)]):
            for ch in c["choices"]:
                texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        assert texts == {0: "xz", 1: "y", 2: "cw"}


def test_a_sample_that_fails_alone_leaves_its_siblings(api):
    orch, port = api
    orch.script = lambda inp, cancel: iter([
        chunk(0, "a"), chunk(1, "b"), chunk(2, "c"), chunk(1, "", FinishReason.ERROR),
        chunk(0, "A", FinishReason.LENGTH), chunk(2, "C", FinishReason.LENGTH)])
    status, raw = request(port, "/v1/completions", BODY)
    assert status == 200
    assert [(c["text"], c["finish_reason"]) for c in json.loads(raw)["choices"]] == [
        ("aA", "length"), ("b", "error"), ("cC", "length")]
    status, raw = request(port, "/v1/completions", {**BODY, "stream": True})
    events = sse(raw)
    assert status == 200 and events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and "sample 1" in errors[0]["error"]["message"]
    texts: dict[int, str] = {}
    for e in events[:-1]:
        for ch in e.get("choices", []):
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {0: "aA", 1: "b", 2: "cC"}


def test_a_request_that_fails_for_every_sample_fails_the_response(api):
    orch, port = api

    def script(inp, cancel):
        yield chunk(0, "a")
        yield chunk(1, "b")
        yield chunk(2, "c")
        raise WorkerFailed("d0", "Decode", "the worker died")

    orch.script = script
    status, raw = request(port, "/v1/completions", BODY)
    assert status >= 500 and "the worker died" in json.loads(raw)["error"]["message"]
