"""Logprobs, echo, lists of prompts, n and penalties through a real cluster (router, 1 prefill,
1 decode worker) with the official `openai` client, against transformers and the local engine.

The checkpoint has its BPE tokenizer (as the named models do), so text goes through it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from baton.client.local import run_local
from baton.client.requests import RequestSpec
from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.request import SamplingParams
from baton.model.chat_template import load_chat_template
from baton.model.make_model import write_checkpoint
from baton.model.tokenizer import load_tokenizer
from tests.integration.cluster_helpers import (
    assert_clean,
    list_workers,
    start_cluster,
    worker_counters,
    write_config,
)
from tests.support.engine_helpers import prompt

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

CONFIG = {
    "cache": {"num_blocks": 512, "num_state_slots": 64,
              "mamba_state_config": {"periodic_snapshot_interval": 16}},
    "router": {"policy": "session", "eject_after_seconds": 10.0, "heartbeat_seconds": 0.5},
    "worker": {"max_num_seqs": 16, "max_model_len": 2048},
    "transfer": {"lease_seconds": 120.0},
}
TEXT = "The capital of France is Paris. The river flows to the sea, and"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    model = write_checkpoint(root / "tiny", tokenizer=True)
    cluster = start_cluster(model, write_config(root / "baton.yaml", CONFIG), prefill=1, decode=1)
    client = openai.OpenAI(base_url=f"{cluster.http_address}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    hf = transformers.NemotronHForCausalLM.from_pretrained(model).eval()
    engine = build_engine(BatonConfig.from_dict(CONFIG), str(model))
    yield {"cluster": cluster, "client": client, "model": model, "hf": hf, "engine": engine,
           "tok": load_tokenizer(model)}
    cluster.stop()


def hf_logprobs(setup, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = setup["hf"](torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def local(setup, ids, **sampling) -> list[int]:
    spec = RequestSpec("l", prompt_ids=list(ids), sampling=SamplingParams(**sampling))
    return run_local(setup["engine"], [spec])[0]["token_ids"]


def post(setup, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"{setup['cluster'].http_address}{path}",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completion_logprobs_equal_transformers(setup):
    ids = setup["tok"].encode(TEXT)
    r = setup["client"].completions.create(model="tiny", prompt=TEXT, max_tokens=6, logprobs=3,
                                           temperature=0, extra_body={"return_token_ids": True,
                                                                      "ignore_eos": True})
    (c,) = r.choices
    gen = c.token_ids
    ref = hf_logprobs(setup, ids + gen[:-1])
    lp = c.logprobs
    assert lp.tokens == [setup["tok"].decode([t]) for t in gen]
    assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
    for k, t in enumerate(gen):
        row = ref[len(ids) - 1 + k]
        assert abs(lp.token_logprobs[k] - float(row[t])) < 1e-4
        top = torch.topk(row, 3)
        want = {setup["tok"].decode([i]): float(v)
                for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)}
        assert set(lp.top_logprobs[k]) >= set(want)
        assert all(abs(lp.top_logprobs[k][s] - v) < 1e-4 for s, v in want.items())
        assert t == int(row.argmax())  # greedy


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_transformers(setup, stream):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say "},
                                             {"type": "text", "text": "hello."}]}]
    text = load_chat_template(setup["model"]).render(
        [{"role": "user", "content": "Say hello."}])
    ids = setup["tok"].encode(text)
    r = setup["client"].chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, logprobs=True, top_logprobs=2,
        temperature=0, stream=stream, extra_body={"return_token_ids": True, "ignore_eos": True})
    if stream:
        chunks = [c for c in r if c.choices]
        gen = [t for c in chunks for t in c.choices[0].token_ids]
        entries = [e for c in chunks for e in (c.choices[0].logprobs.content or [])]
    else:
        gen, entries = r.choices[0].token_ids, r.choices[0].logprobs.content
    assert len(gen) == len(entries) == 5
    ref = hf_logprobs(setup, ids + gen[:-1])
    for k, (t, e) in enumerate(zip(gen, entries, strict=True)):
        row = ref[len(ids) - 1 + k]
        assert e.token == setup["tok"].decode([t])
        assert abs(e.logprob - float(row[t])) < 1e-4
        assert [x.token for x in e.top_logprobs] == \
            [setup["tok"].decode([i]) for i in torch.topk(row, 2).indices.tolist()]
        assert e.bytes == list(e.token.encode())


def _echo(setup, p, **kw):
    return setup["client"].completions.create(model="tiny", prompt=p, max_tokens=0, echo=True,
                                              logprobs=1, temperature=0, **kw)


def test_echo_scores_the_prompt_exactly_even_after_a_prefix_hit(setup):
    p = prompt(5, 40, vocab=500)
    cold = _echo(setup, p, extra_body={"session_id": "echo"})
    (c,) = cold.choices
    ref = hf_logprobs(setup, p)
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert len(c.logprobs.token_logprobs) == 40 and c.finish_reason == "length"
    for j in range(1, 40):
        assert abs(c.logprobs.token_logprobs[j] - float(ref[j - 1][p[j]])) < 1e-4
    assert c.text == setup["tok"].decode(p) and cold.usage.completion_tokens == 0
    # a plain request of the same prompt + more now hits the prefill worker's cache...
    plain = setup["client"].completions.create(model="tiny", prompt=p + [7], max_tokens=1,
                                               temperature=0, extra_body={"session_id": "echo"})
    assert plain.usage.prompt_tokens_details.cached_tokens == 40  # the echo left its end
    # ...and echo of the same prompt computes it whole: the same values
    warm = _echo(setup, p, extra_body={"session_id": "echo"})
    assert warm.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].logprobs.token_logprobs == c.logprobs.token_logprobs
    assert warm.choices[0].logprobs.top_logprobs == c.logprobs.top_logprobs


def test_a_list_of_prompts_gets_one_choice_each_in_order_as_lm_eval_sends_it(setup):
    prompts = [prompt(20 + i, 6 + 3 * i, vocab=500) for i in range(3)]
    r = setup["client"].completions.create(model="tiny", prompt=prompts, max_tokens=1, echo=True,
                                           logprobs=1, temperature=0, seed=1234)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(prompts, r.choices, strict=True):
        alone = _echo(setup, p).choices[0]
        lps = c.logprobs.token_logprobs
        assert len(lps) == len(p) + 1 and lps[:-1] == alone.logprobs.token_logprobs
        (want,) = local(setup, p, max_tokens=1)
        assert c.text == setup["tok"].decode(p + [want])
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 3


def test_n_choices_with_a_seed_are_reproducible_and_equal_the_local_engine(setup):
    p = prompt(33, 12, vocab=500)
    body = dict(model="tiny", prompt=p, max_tokens=6, n=4, temperature=1.0, seed=77,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    a = setup["client"].completions.create(**body)
    b = setup["client"].completions.create(**body)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    got = [c.token_ids for c in a.choices]
    assert got == [c.token_ids for c in b.choices]
    assert len({tuple(g) for g in got}) > 1  # the samples differ from each other
    for i, ids in enumerate(got):  # choice i draws with seed + i
        assert ids == local(setup, p, max_tokens=6, temperature=1.0, seed=77 + i,
                            ignore_eos=True)
    assert a.usage.prompt_tokens == 12 and a.usage.completion_tokens == 24


def test_penalties_bias_and_min_tokens_equal_the_local_engine(setup):
    p = prompt(44, 20, vocab=500)
    eos = 2
    sampling = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3,
                    logit_bias={str(eos): 30.0, "17": 2.5})
    r = setup["client"].completions.create(
        model="tiny", prompt=p, max_tokens=8, temperature=0, **{k: v for k, v in sampling.items()
                                                              if k in ("presence_penalty",
                                                                       "frequency_penalty",
                                                                       "logit_bias")},
        extra_body={"return_token_ids": True, "repetition_penalty": 1.3, "min_tokens": 5})
    (c,) = r.choices
    want = local(setup, p, max_tokens=8, presence_penalty=0.8, frequency_penalty=0.5,
                 repetition_penalty=1.3, logit_bias=((eos, 30.0), (17, 2.5)), min_tokens=5)
    # the bias makes EOS the argmax, min_tokens holds it back for exactly 5 tokens
    assert c.token_ids == want and len(want) == 6 and want[-1] == eos
    assert c.finish_reason == "stop"
    plain = local(setup, p, max_tokens=8, ignore_eos=True)
    assert plain != want[:5]


def test_bad_values_name_the_field_and_the_limit(setup):
    good = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    cases = [
        ({**good, "logprobs": 21}, "logprobs", "20"),
        ({**good, "n": 17}, "n", "16"),
        ({**good, "min_tokens": -1}, "min_tokens", "0"),
        ({**good, "logit_bias": {"1000000": 1.0}}, "logit_bias", "512"),
        ({**good, "max_tokens": 0}, "max_tokens", "echo"),
        ({**good, "best_of": 3}, "best_of", "n"),
    ]
    for body, param, limit in cases:
        code, reply = post(setup, "/v1/completions", body)
        assert (code, reply["error"]["param"]) == (400, param), reply
        assert limit in reply["error"]["message"], reply
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for body, param in [({**chat, "echo": True}, "echo"),
                        ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                        ({"model": "tiny", "messages": [{"role": "user", "content": [
                            {"type": "image_url", "image_url": {"url": "x"}}]}]},
                         "messages[0].content")]:
        code, reply = post(setup, "/v1/chat/completions", body)
        assert (code, reply["error"]["param"]) == (400, param), reply
    assert "image_url" in reply["error"]["message"]


def test_tokenize_detokenize_and_models(setup):
    code, r = post(setup, "/tokenize", {"model": "tiny", "prompt": TEXT})
    assert code == 200 and r["tokens"] == setup["tok"].encode(TEXT)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    code, d = post(setup, "/detokenize", {"model": "tiny", "tokens": r["tokens"]})
    assert code == 200 and d["prompt"] == TEXT
    msgs = [{"role": "user", "content": "hi"}]
    code, c = post(setup, "/tokenize", {"messages": msgs})
    assert c["tokens"] == setup["tok"].encode("<|user|>\nhi\n<|assistant|>\n")
    (card,) = setup["client"].models.list().data
    assert card.max_model_len == 2048


def test_prefill_worker_counts_the_echo_prompt_once(setup):
    p = prompt(55, 30, vocab=500)
    (w,) = [w for w in list_workers(setup["cluster"].address, setup["cluster"].secret.bearer)
            if w.role == 1]

    def computed():
        return worker_counters(w, setup["cluster"].secret.bearer).get("prefilled_tokens")

    before = computed()
    _echo(setup, p)
    assert before is not None and computed() - before == 30


def test_streamed_choices_carry_their_index_and_logprobs(setup):
    prompts = [prompt(60, 9, vocab=500), prompt(61, 14, vocab=500)]
    body = dict(model="tiny", prompt=prompts, max_tokens=5, n=2, temperature=0.9, seed=3,
                logprobs=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = setup["client"].completions.create(**body)
    chunks = list(setup["client"].completions.create(**body, stream=True,
                                                     stream_options={"include_usage": True}))
    got: dict[int, list] = {}
    lps: dict[int, list] = {}
    for c in chunks:
        for ch in c.choices:
            got.setdefault(ch.index, []).extend(ch.token_ids)
            lps.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs)
    assert sorted(got) == [0, 1, 2, 3]
    for c in whole.choices:  # the batch around a decode step moves the last float bits only
        assert got[c.index] == c.token_ids
        assert max(abs(a - b) for a, b in zip(lps[c.index], c.logprobs.token_logprobs,
                                              strict=True)) < 1e-4
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == 23


def test_grpc_generate_and_baton_generate_json_carry_logprobs(setup):
    from baton.client.remote import run_remote

    p = prompt(70, 21, vocab=500)
    s = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    (remote,) = run_remote(setup["cluster"].address,
                           [RequestSpec("g", prompt_ids=p, sampling=s)])
    (here,) = run_local(setup["engine"], [RequestSpec("g", prompt_ids=p, sampling=s)])
    assert remote["token_ids"] == here["token_ids"]
    assert len(remote["logprobs"]) == 4 and len(remote["prompt_logprobs"]) == 20
    for key in ("logprobs", "prompt_logprobs"):
        for a, b in zip(remote[key], here[key], strict=True):
            assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-4
            assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
    assert [lp["token_id"] for lp in remote["prompt_logprobs"]] == p[1:]


def test_streamed_echo_puts_the_scored_prompt_in_the_first_chunk(setup):
    p = prompt(80, 11, vocab=500)
    body = dict(model="tiny", prompt=p, max_tokens=3, echo=True, logprobs=1, temperature=0,
                extra_body={"ignore_eos": True})
    whole = setup["client"].completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in setup["client"].completions.create(**body, stream=True)
              if c.choices]
    assert chunks[0].text.startswith(setup["tok"].decode(p))
    assert "".join(c.text for c in chunks) == whole.text
    lps = [v for c in chunks for v in c.logprobs.token_logprobs]
    offsets = [v for c in chunks for v in c.logprobs.text_offset]
    assert lps[0] is None and len(lps) == 14 and offsets == whole.logprobs.text_offset
    assert all(abs(a - b) < 1e-4 for a, b in zip(lps[1:], whole.logprobs.token_logprobs[1:],
                                                 strict=True))


def _computed(setup) -> dict[int, float]:
    """Prompt tokens each worker computed (Stats `prefilled_tokens`), by role (1: prefill)."""
    c = setup["cluster"]
    return {w.role: worker_counters(w, c.secret.bearer)["prefilled_tokens"]
            for w in list_workers(c.address, c.secret.bearer)}


def _assert_idle(setup) -> None:
    """Every sample's blocks, slots and bookkeeping are back on both workers."""
    for c in assert_clean(setup["cluster"]).values():
        assert c["slots_live"] == 0 and c["tracked_sample_families"] == 0, c
        assert c["tracked_output_callbacks"] == 0, c
        assert c["blocks_free"] + c["blocks_evictable"] == c["blocks_total"], c


def test_n_4_shares_one_prefill_and_greedy_choices_equal_one_request(setup):
    p = prompt(90, 29, vocab=500)
    body = dict(model="tiny", prompt=p, max_tokens=7, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    before = _computed(setup)
    r = setup["client"].completions.create(**body, n=4)
    after = _computed(setup)
    assert (after[1] - before[1], after[2] - before[2]) == (29, 0)  # once, on the prefill side
    (one,) = setup["client"].completions.create(**body).choices
    assert one.token_ids == local(setup, p, max_tokens=7, ignore_eos=True)
    assert [c.token_ids for c in r.choices] == [one.token_ids] * 4
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 29 and r.usage.completion_tokens == 28
    _assert_idle(setup)


def test_n_4_chat_with_a_seed_keeps_each_choice_and_computes_the_prompt_once(setup):
    msgs = [{"role": "user", "content": "Name a river that flows to the sea."}]
    ids = setup["tok"].encode("<|user|>\nName a river that flows to the sea.\n<|assistant|>\n")
    before = _computed(setup)
    r = setup["client"].chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, n=4, temperature=0.9, seed=5,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    assert _computed(setup)[1] - before[1] == len(ids) == r.usage.prompt_tokens
    got = [c.token_ids for c in r.choices]
    assert len({tuple(g) for g in got}) == 4  # the samples differ from each other
    for i, toks in enumerate(got):  # choice i is what choice i was as a request of its own
        assert toks == local(setup, ids, max_tokens=6, temperature=0.9, seed=5 + i,
                             ignore_eos=True)
    assert r.usage.completion_tokens == 24
    _assert_idle(setup)


def test_a_stop_in_one_choice_does_not_end_the_others(setup):
    p = prompt(91, 18, vocab=500)
    s = dict(max_tokens=8, temperature=1.0, seed=9, ignore_eos=True)
    free = [local(setup, p, **{**s, "seed": 9 + i}) for i in range(3)]
    stop = free[1][3]
    assert all(stop not in f for f in (free[0], free[2]))
    body = dict(model="tiny", prompt=p, n=3, max_tokens=8, temperature=1.0, seed=9)
    r = setup["client"].completions.create(**body, extra_body={
        "return_token_ids": True, "ignore_eos": True, "stop_token_ids": [stop]})
    assert [c.token_ids for c in r.choices] == [free[0], free[1][:4], free[2]]
    assert [c.finish_reason for c in r.choices] == ["length", "stop", "length"]
    # a stop string: the router ends that sample alone on the decode worker
    texts = [setup["tok"].decode(f) for f in free]
    word = next(w for k in range(1, len(texts[0]) - 2) for w in [texts[0][k:k + 3]]
                if w.strip() and all(w not in t for t in texts[1:]))
    for stream in (False, True):
        out = setup["client"].completions.create(**body, stop=[word], stream=stream,
                                                 extra_body={"ignore_eos": True})
        got: dict[int, str] = {}
        for chunk in (out if stream else [out]):
            for c in chunk.choices:
                got[c.index] = got.get(c.index, "") + c.text
        assert got == {0: texts[0][:texts[0].index(word)], 1: texts[1], 2: texts[2]}, word
    _assert_idle(setup)


def test_n_above_what_the_decode_cache_holds_names_n_and_the_limit(setup):
    code, reply = post(setup, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7],
                                                  "max_tokens": 2000, "n": 16})
    assert (code, reply["error"]["param"]) == (400, "n"), reply
    assert "lower n to at most 4" in reply["error"]["message"], reply


def test_a_client_that_leaves_cancels_every_sample(setup):
    body = dict(model="tiny", prompt=prompt(92, 25, vocab=500), max_tokens=400, n=3,
                temperature=0.8, seed=1, stream=True, extra_body={"ignore_eos": True})
    stream = setup["client"].completions.create(**body)
    seen = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices)
        if len(seen) == 3:
            break
    stream.close()
    _assert_idle(setup)


def test_n_samples_on_a_decode_worker_alone_compute_the_increment_once(setup):
    """Conditional disaggregation: the decode worker holds the last turn, prefills the new
    tokens itself once and forks its samples there."""
    p = prompt(93, 20, vocab=500)
    body = dict(model="tiny", max_tokens=5, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
    (turn,) = setup["client"].completions.create(prompt=p, **body).choices
    p2 = p + turn.token_ids + [7, 8, 9]
    before = _computed(setup)
    s = dict(max_tokens=5, temperature=0.9, seed=4)
    r = setup["client"].completions.create(model="tiny", prompt=p2, n=3, **s,
                                           extra_body={"return_token_ids": True,
                                                       "ignore_eos": True})
    after = _computed(setup)
    assert r.model_extra["baton"]["prefill_worker"] == ""
    assert (after[1] - before[1], after[2] - before[2]) == (0, 3)
    assert [c.token_ids for c in r.choices] == [
        local(setup, p2, **{**s, "seed": 4 + i}, ignore_eos=True) for i in range(3)]
    _assert_idle(setup)


def test_echo_and_logprobs_with_n_give_every_choice_the_scored_prompt(setup):
    p = prompt(94, 14, vocab=500)
    body = dict(model="tiny", prompt=p, max_tokens=3, echo=True, logprobs=2, temperature=0.8,
                seed=6, extra_body={"ignore_eos": True, "return_token_ids": True})
    (one,) = setup["client"].completions.create(**body).choices
    r = setup["client"].completions.create(**body, n=2)
    lp, first = one.logprobs.token_logprobs, r.choices[0].logprobs.token_logprobs
    assert first[:14] == lp[:14] and r.choices[0].text == one.text
    # the decode batch of two moves the last float bits of the answer's logprobs only
    assert max(abs(a - b) for a, b in zip(first[14:], lp[14:], strict=True)) < 1e-4
    second = r.choices[1].logprobs.token_logprobs
    assert second[:14] == lp[:14] and len(second) == 17  # the prompt scored once, for both
    assert r.choices[1].text.startswith(setup["tok"].decode(p))
    _assert_idle(setup)


def test_grpc_generate_streams_every_sample_as_baton_generate_local_does(setup):
    from baton.client.remote import run_remote

    s = SamplingParams(max_tokens=5, temperature=0.9, seed=8, ignore_eos=True, n=3)
    spec = RequestSpec("g", prompt_ids=prompt(95, 19, vocab=500), sampling=s)
    remote = run_remote(setup["cluster"].address, [spec])
    here = run_local(setup["engine"], [spec])
    assert [(r["index"], r["token_ids"]) for r in remote] == \
        [(r["index"], r["token_ids"]) for r in here]
    assert [r["index"] for r in remote] == [0, 1, 2] and remote[0]["prefill_worker"]
    _assert_idle(setup)


def test_samples_that_all_end_at_their_first_token_free_the_reservation(setup):
    p = prompt(96, 17, vocab=500)
    body = dict(model="tiny", prompt=p, max_tokens=1, temperature=1.0, seed=2,
                extra_body={"return_token_ids": True})
    r = setup["client"].completions.create(**body, n=3)
    assert [c.token_ids for c in r.choices] == [
        local(setup, p, max_tokens=1, temperature=1.0, seed=2 + i) for i in range(3)]
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    _assert_idle(setup)
