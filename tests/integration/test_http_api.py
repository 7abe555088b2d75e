"""The OpenAI-compatible HTTP API and Prometheus metrics of a real cluster (router, 1 prefill,
1 decode worker), driven by the official `openai` client and by raw HTTP.

One cluster for the module. The tiny checkpoint has no tokenizer.json, so text is the byte-level
fallback (one id a byte; ids past 258 decode to nothing) and answers are compared by token ids.
"""

from __future__ import annotations

import functools
import http.client
import itertools
import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.client.local import run_local
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.model.chat_template import load_chat_template
from baton.model.nemotron_h.config import ModelConfig
from baton.model.tokenizer import ByteTokenizer
from baton.proto_gen import baton_pb2
from tests.integration.cluster_helpers import (
    assert_clean,
    list_workers,
    start_cluster,
    write_config,
)
from tests.support.engine_helpers import make_checkpoint, prompt

pytestmark = pytest.mark.integration

CONFIG = {
    "cache": {
        "num_blocks": 512,
        "num_state_slots": 64,
        "mamba_state_config": {
            "periodic_snapshot_interval": 32,
            "additional_snapshot_offsets_from_end": [0],
            "decode_end_snapshot": True,
        },
    },
    "router": {"policy": "session", "eject_after_seconds": 10.0, "heartbeat_seconds": 0.5},
    "worker": {"max_num_seqs": 16, "max_model_len": 2048},
    "transfer": {"lease_seconds": 120.0},
}
TPB = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    model = make_checkpoint(root)  # folder "tiny": the served model name
    cluster = start_cluster(model, write_config(root / "baton.yaml", CONFIG), prefill=1, decode=1)
    client = openai.OpenAI(base_url=f"{cluster.http_address}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    engine = build_engine(BatonConfig.from_dict(CONFIG), str(model))
    yield {"cluster": cluster, "client": client, "model": model, "engine": engine}
    cluster.stop()


def local_ids(setup, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    specs = [RequestSpec(f"l{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=max_tokens,
                                                                        ignore_eos=True))
             for i, p in enumerate(prompts)]
    return [r["token_ids"] for r in run_local(setup["engine"], specs)]


def greedy(**extra) -> dict:
    return {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True,
                                             **extra}}


def post(setup, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{setup['cluster'].http_address}{path}", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def scrape(url: str, families: set | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, parsed by the official parser: (name, labels) -> value.
    `families` collects the metric names, sampled or not."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        if families is not None:
            families.add(fam.name)
        out.update({(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples})
    return out


def metric_urls(setup) -> dict[str, str]:
    c = setup["cluster"]
    urls = {role: f"http://127.0.0.1:{port}/metrics" for role, port in c.metrics_ports}
    return {"router": f"{c.http_address}/metrics", **urls}


def test_completions_equal_local_engine(setup):
    prompts = [prompt(10 + i, 7 + 9 * i) for i in range(3)]
    want = local_ids(setup, prompts, 6)
    for p, ids in zip(prompts, want, strict=True):
        r = setup["client"].completions.create(model="tiny", prompt=p, max_tokens=6, **greedy())
        (choice,) = r.choices
        assert choice.token_ids == ids
        assert choice.text == ByteTokenizer().decode(ids)
        assert choice.finish_reason == "length" and r.object == "text_completion"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(p), 6)
        assert r.usage.total_tokens == len(p) + 6
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert r.baton["prefill_worker"].startswith("prefill-")
        assert r.baton["decode_worker"].startswith("decode-")


def test_streamed_completion_equals_local_engine(setup):
    p = prompt(40, 30)
    (want,) = local_ids(setup, [p], 9)
    stream = setup["client"].completions.create(
        model="tiny", prompt=p, max_tokens=9, stream=True,
        stream_options={"include_usage": True}, **greedy())
    chunks = list(stream)
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == want
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ByteTokenizer().decode(want)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes == [None] * (len(finishes) - 1) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == 30


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_local_engine_on_the_rendered_template(setup, stream):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Say something {int(stream)}."}]
    text = load_chat_template(setup["model"]).render(messages)
    assert text.endswith("<|assistant|>\n") and "<|user|>\nSay something" in text
    ids = ByteTokenizer().encode(text)
    (want,) = local_ids(setup, [ids], 7)
    r = setup["client"].chat.completions.create(
        model="tiny", messages=messages, max_tokens=7, stream=stream,
        **({"stream_options": {"include_usage": True}} if stream else {}), **greedy())
    if stream:
        chunks = list(r)
        assert chunks[0].choices[0].delta.role == "assistant"
        got = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage, finish = chunks[-1].usage, chunks[-2].choices[0].finish_reason
        assert all(c.object == "chat.completion.chunk" for c in chunks)
    else:
        got, content = r.choices[0].token_ids, r.choices[0].message.content
        usage, finish = r.usage, r.choices[0].finish_reason
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert got == want and content == ByteTokenizer().decode(want)
    assert (usage.prompt_tokens, usage.completion_tokens, finish) == (len(ids), 7, "length")


def test_cached_tokens_on_a_repeated_prefix(setup):
    base = prompt(900, 96)
    cached = []
    for i in range(3):
        r = setup["client"].completions.create(
            model="tiny", prompt=base + prompt(901 + i, 5 + i), max_tokens=3,
            **greedy(session_id="shared-prefix"))
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert r.baton["cached_tokens"] == cached[-1]
        assert r.baton["session_id"] == "shared-prefix"
    # periodic snapshots at 32, 64, 96 of the first prompt: the others reuse exactly 96
    assert cached == [0, 96, 96]


def test_stop_string_ends_the_answer_before_it(setup):
    p = prompt(41, 12)
    (want,) = local_ids(setup, [p], 40)
    full = ByteTokenizer().decode(want)
    printable = [c for c in full if c.isalnum()]
    stop = printable[len(printable) // 2]
    r = setup["client"].completions.create(model="tiny", prompt=p, max_tokens=40, stop=[stop],
                                           **greedy())
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40


@dataclass
class Reply:
    """One answer as the official client parsed it (streamed: joined from its chunks)."""

    text: str
    token_ids: list[int]
    finish: str
    usage: openai.types.CompletionUsage
    baton: dict


def ask(setup, api: str, prompt_of: list[int] | str, stream: bool, **kw) -> Reply:
    """A greedy request for 40 tokens through the `openai` client: /v1/completions of the
    prompt ids `prompt_of`, or (`api` "chat") /v1/chat/completions of one user message."""
    client = setup["client"]
    if api == "chat":
        create = functools.partial(client.chat.completions.create,
                                   messages=[{"role": "user", "content": prompt_of}])
    else:
        create = functools.partial(client.completions.create, prompt=prompt_of)
    if stream:
        kw["stream_options"] = {"include_usage": True}
    r = create(model="tiny", max_tokens=40, stream=stream, **kw, **greedy())
    if not stream:
        (c,) = r.choices
        text = c.message.content if api == "chat" else c.text
        return Reply(text, c.token_ids, c.finish_reason, r.usage, r.baton)
    *answer, last = list(r)
    assert last.choices == [] and all(len(c.choices) == 1 for c in answer)
    finishes = [c.choices[0].finish_reason for c in answer]
    assert finishes[:-1] == [None] * (len(answer) - 1) and finishes[-1] is not None
    assert [hasattr(c, "baton") for c in answer] == [False] * (len(answer) - 1) + [True]
    pieces = [c.choices[0].delta.content if api == "chat" else c.choices[0].text
              for c in answer]
    return Reply("".join(p or "" for p in pieces),
                 [t for c in answer for t in c.choices[0].token_ids], finishes[-1],
                 last.usage, answer[-1].baton)


def early_stop(ids: list[int]) -> tuple[str, int]:
    """A stop string the answer `ids` provably contains, and the tokens it takes to complete
    it: printable ASCII characters (one byte token each), two when some pair has only tokens
    without text between them, at the point where that text first occurs, at least 5 tokens
    before the end."""
    tok = ByteTokenizer()
    full = tok.decode(ids)
    chars = [k for k in range(2, len(ids) - 5)
             if len(c := tok.decode(ids[k:k + 1])) == 1 and c.isascii() and c.isprintable()]
    pairs = [(a, b) for a, b in itertools.pairwise(chars) if tok.decode(ids[a + 1:b]) == ""]
    for a, b in pairs + [(k, k) for k in chars]:
        stop = tok.decode([ids[a], ids[b]] if a != b else [ids[a]])
        if full.find(stop) == len(tok.decode(ids[:a])):
            return stop, b + 1
    raise AssertionError(f"no printable character to stop at in {full!r}")


def stop_like_a_finish(setup, api: str, prompt_of, stream: bool, cached: int) -> tuple:
    """The request `prompt_of` three times: as is (after any earlier turn: the answer to cut),
    ended early by a stop string taken from that answer, and as is again (the reference).
    The stopped answer is the first cut before the stop string, with the tokens through the
    one that completed it, and reports `cached` prompt tokens and the workers the reference
    reports; nothing stays held anywhere. Returns (prefill worker, decode worker) it names."""
    cluster = setup["cluster"]
    first = ask(setup, api, prompt_of, stream)
    assert (first.finish, first.usage.completion_tokens) == ("length", 40)
    stop, upto = early_stop(first.token_ids)
    stopped = ask(setup, api, prompt_of, stream, stop=[stop])
    again = ask(setup, api, prompt_of, stream)
    assert again.token_ids == first.token_ids and again.finish == "length"

    assert stopped.finish == "stop"
    assert stopped.text == first.text[: first.text.index(stop)]
    assert stopped.token_ids == first.token_ids[:upto]
    n_prompt = first.usage.prompt_tokens
    assert (stopped.usage.prompt_tokens, stopped.usage.completion_tokens,
            stopped.usage.total_tokens) == (n_prompt, upto, n_prompt + upto)
    assert stopped.usage.prompt_tokens_details.cached_tokens == cached
    assert again.usage.prompt_tokens_details.cached_tokens == cached
    assert stopped.baton["cached_tokens"] == cached
    served = (stopped.baton["prefill_worker"], stopped.baton["decode_worker"])
    assert served == (again.baton["prefill_worker"], again.baton["decode_worker"])
    assert_clean(cluster)
    return served


def roles(cluster) -> dict[str, int]:
    """Worker id -> role, as the router's ListWorkers reports them."""
    return {w.worker_id: w.role for w in list_workers(cluster.address, cluster.secret.bearer)}


@pytest.mark.parametrize("api", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_ended_by_a_stop_string_keeps_its_accounting(setup, api, stream):
    """A stop string cancels the request on both workers, yet the answer reports what one that
    ended by max_tokens does: the cached prompt tokens, the workers that served it, the tokens
    through the one that completed the stop string; nothing stays held on any worker."""
    seed = 600 + 2 * (api == "chat") + stream
    if api == "chat":
        prompt_of = f"Message {seed}: " + "what comes next after all these words? " * 2
        n_prompt = len(load_chat_template(setup["model"]).render(
            [{"role": "user", "content": prompt_of}]).encode())
    else:
        prompt_of = prompt(seed, 70)
        n_prompt = 70
    # the first of the three requests leaves the prompt's snapshots on the prefill worker
    # (every 32 tokens and at its end); an exact repeat reuses the deepest one before its last
    # token, whose logits are needed (shared/DOMAIN.md, "Snapshot points")
    cached = (n_prompt - 1) // 32 * 32
    served = stop_like_a_finish(setup, api, prompt_of, stream, cached)
    workers = roles(setup["cluster"])
    assert workers[served[0]] == baton_pb2.WORKER_ROLE_PREFILL
    assert workers[served[1]] == baton_pb2.WORKER_ROLE_DECODE


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_on_the_decode_worker_alone_keeps_its_accounting(setup, stream):
    """The next turn of a conversation runs on the decode worker alone (it holds the turn's
    decode-end snapshot): stopped, it still names that worker and the tokens it reused."""
    turn = prompt(620 + stream, 70)
    answer = ask(setup, "completions", turn, stream).token_ids
    cached = len(turn) + len(answer)  # the decode-end snapshot: prompt and answer
    served = stop_like_a_finish(setup, "completions", turn + answer + prompt(630 + stream, 6),
                                stream, cached)
    assert served[0] == "" and roles(setup["cluster"])[served[1]] == baton_pb2.WORKER_ROLE_DECODE


def test_models_and_health(setup):
    models = setup["client"].models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with urllib.request.urlopen(f"{setup['cluster'].http_address}/health", timeout=10) as r:
        assert (r.status, json.loads(r.read())) == (
            200, {"status": "ready", "prefill_workers": 1, "decode_workers": 1})


GOOD = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
BAD_REQUESTS = [
    # (name, raw body, status, param)
    ("missing model", {k: v for k, v in GOOD.items() if k != "model"}, 400, "model"),
    ("unknown model", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("negative max_tokens", {**GOOD, "max_tokens": -3}, 400, "max_tokens"),
    ("temperature NaN", b'{"model": "tiny", "prompt": [5], "temperature": NaN}', 400,
     "temperature"),
    ("unknown field", {**GOOD, "frobnicate": 1}, 400, "frobnicate"),
    ("prompt over max length", {**GOOD, "prompt": [5] * 3000}, 400, "prompt"),
    ("prompt + max_tokens over max length", {**GOOD, "prompt": [5] * 2000, "max_tokens": 100},
     400, "max_tokens"),
    ("token id outside the vocabulary", {**GOOD, "prompt": [5, 10**6]}, 400, "prompt"),
    ("logprobs over 20", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("n over the limit", {**GOOD, "n": 17}, 400, "n"),
    ("malformed JSON", b'{"model": "tiny", "prompt": [5', 400, None),
    ("10 MB body", json.dumps({**GOOD, "prompt": "x" * (10 * 2**20)}).encode(), 413, None),
]


@pytest.mark.parametrize("name, body, status, param", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(setup, name, body, status,
                                                                    param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, reply = post(setup, "/v1/completions", raw)
    assert code == status, reply
    assert set(reply) == {"error"}
    assert set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["param"] == param and reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"
    code, ok = post(setup, "/v1/completions", json.dumps(GOOD).encode())
    assert code == 200 and ok["usage"]["completion_tokens"] == 2


def test_bad_chat_request_raises_the_clients_error_class(setup):
    with pytest.raises(openai.BadRequestError) as err:
        setup["client"].chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=3.0)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        setup["client"].chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}])


def test_metrics_of_every_process_parse_and_count_a_known_batch(setup):
    assert_clean(setup["cluster"])
    urls = metric_urls(setup)
    before = {k: scrape(u) for k, u in urls.items()}
    prompts = [prompt(700 + i, n) for i, n in enumerate((40, 20, 33))]
    for p in prompts:
        setup["client"].completions.create(model="tiny", prompt=p, max_tokens=5, **greedy())
    names: set[str] = set()
    after = {k: scrape(u, names) for k, u in urls.items()}

    def delta(proc: str, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[proc][key] - before[proc].get(key, 0.0)

    http_len = {"api": "http", "outcome": "length"}
    assert delta("router", "baton_router_requests_total", **http_len) == 3
    assert delta("router", "baton_router_generation_tokens_total") == 15
    assert delta("router", "baton_router_prompt_tokens_total") == 93
    assert delta("router", "baton_router_time_to_first_token_seconds_count") == 3
    assert delta("router", "baton_router_inter_token_latency_seconds_count") == 12
    assert delta("router", "baton_router_e2e_request_latency_seconds_count") == 3
    assert after["router"][("baton_router_requests_running", ())] == 0
    assert after["router"][("baton_router_workers", (("role", "prefill"),))] == 1

    p, d = {"role": "prefill"}, {"role": "decode"}
    assert delta("prefill", "baton_worker_requests_total", outcome="handed_off", **p) == 3
    assert delta("prefill", "baton_handoffs_total", **p) == 3
    assert delta("prefill", "baton_handoff_bytes_count", **p) == 3
    assert delta("prefill", "baton_handoff_bytes_sum", **p) == sum(
        handoff_bytes(setup["model"], len(x)) for x in prompts)
    assert delta("prefill", "baton_prefix_queried_tokens_total", **p) == 93
    assert delta("prefill", "baton_worker_generation_tokens_total", **p) == 3
    assert delta("decode", "baton_handoffs_total", **d) == 3
    assert delta("decode", "baton_worker_requests_total", outcome="length", **d) == 3
    assert delta("decode", "baton_worker_generation_tokens_total", **d) == 12
    for role, labels in (("prefill", p), ("decode", d)):
        s = after[role]
        key = tuple(labels.items())
        assert s[("baton_kv_blocks_used", key)] + s[("baton_kv_blocks_free", key)] == 512
        assert s[("baton_state_slots_used", key)] + s[("baton_state_slots_free", key)] == 64
        assert s[("baton_requests_running", key)] == 0
    assert all(n.startswith("baton_") for n in names)
    assert dashboard_metrics() <= names


def dashboard_metrics() -> set[str]:
    """The metric families deploy/grafana/baton.json queries."""
    text = (Path(__file__).parents[2] / "deploy" / "grafana" / "baton.json").read_text()
    found = re.findall(r"baton_[a-z0-9_]+", text)
    return {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in found}


def handoff_bytes(model_dir, prompt_len: int) -> int:
    """What one handoff of a fresh prompt moves, from the checkpoint's shapes (float32): K and V
    of every prompt block of every attention layer, conv + SSM state of every Mamba layer."""
    c = ModelConfig.from_dir(model_dir)
    blocks = -(-prompt_len // TPB)
    kv = len(c.attention_layers) * blocks * 2 * TPB * c.num_key_value_heads * c.head_dim * 4
    conv = c.conv_dim * (c.conv_kernel - 1) * 4
    ssm = c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size * 4
    return kv + len(c.mamba_layers) * (conv + ssm)


def test_client_disconnect_mid_stream_frees_both_workers(setup):
    urls = metric_urls(setup)
    before, decode_before = scrape(urls["router"]), scrape(urls["decode"])
    host, port = setup["cluster"].http_address.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 1500, "stream": True, "ignore_eos": True, "temperature": 0}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = 0
    while events < 5:
        line = resp.readline()
        events += line.startswith(b"data: {")
    conn.sock.close()  # the client goes away mid-answer
    conn.close()
    assert_clean(setup["cluster"])
    key = ("baton_router_requests_total", (("api", "http"), ("outcome", "cancelled")))
    deadline = time.monotonic() + 10
    while scrape(urls["router"]).get(key, 0) - before.get(key, 0) != 1:
        assert time.monotonic() < deadline, "the router did not count the request as cancelled"
        time.sleep(0.1)
    key = ("baton_worker_generation_tokens_total", (("role", "decode"),))
    assert scrape(urls["decode"])[key] - decode_before.get(key, 0) < 1000  # stopped, not finished


def test_baton_router_prints_both_addresses_and_is_not_ready_alone(setup):
    import signal
    import subprocess
    import sys

    from baton.cluster.local import free_port

    grpc_port, http_port = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "--log-level", "WARNING", "router", "--port",
         str(grpc_port), "--http-port", str(http_port), "--model", str(setup["model"])],
        stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line == (f"router serving gRPC on 0.0.0.0:{grpc_port} and HTTP on "
                        f"http://0.0.0.0:{http_port}\n")
        # no torch in a router (test_cli: the parser's train flags, the grammars' masks)
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        url = f"http://127.0.0.1:{http_port}"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}/health", timeout=10)
        assert err.value.code == 503
        assert json.loads(err.value.read()) == {"status": "not ready", "prefill_workers": 0,
                                                "decode_workers": 0}
        names: set[str] = set()
        scrape(f"{url}/metrics", names)
        assert {"baton_router_requests", "baton_router_workers"} <= names
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
