"""The request flow with plain-python fake workers: validation, retries, aborts, summaries."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest

from baton.config.router import RouterConfig
from baton.contract import (
    DecodeChunk,
    FinishReason,
    GenerateInput,
    PrefillResult,
    Reservation,
    Role,
    SamplingParams,
    WorkerInfo,
)
from baton.errors import (
    CapacityError,
    InvalidRequestError,
    NoWorkersError,
    RequestCancelled,
    WorkerBusy,
    WorkerFailed,
)
from router.cancellation import Cancellation
from router.orchestrator import Orchestrator
from router.policies import make_policy
from router.registry import Registry


class FakeClient:
    """`fail` maps a method to the exception it raises."""

    def __init__(self, worker_id, log, fail=None, finished=False):
        self.worker_id, self.log, self.fail, self.finished = worker_id, log, fail or {}, finished

    def _enter(self, method, rid):
        self.log.append((self.worker_id, method, rid))
        if method in self.fail:
            raise self.fail[method]

    def reserve(self, req, cancel):
        self._enter("reserve", req.request_id)
        return Reservation(self.worker_id, "tcp://x", (0, 1), 0)

    def start_prefill(self, req, cancel):
        return _DeferredPrefill(self, req, cancel)

    def prefill(self, req, cancel):
        self._enter("prefill", req.request_id)
        assert req.destination.worker_id.startswith("d")
        reason = FinishReason.STOP if self.finished else None
        return PrefillResult(req.prompt_ids[-1] + 1, 3, self.finished, reason)

    def decode(self, rid, first, cancel):
        self._enter("decode", rid)
        yield DecodeChunk((first + 1,))
        if cancel.cancelled:  # as the gRPC client: the call was cancelled under the reader
            raise RequestCancelled(f"request {rid} cancelled during Decode")
        if "decode_mid" in self.fail:
            raise self.fail["decode_mid"]
        yield DecodeChunk((first + 2,), FinishReason.LENGTH)

    def abort(self, rid):
        self.log.append((self.worker_id, "abort", rid))
        return True


class _DeferredPrefill:
    """The Prefill stream of an in-process fake: it runs once the destination arrives."""

    def __init__(self, client, req, cancel):
        self.client, self.req, self.cancel_ = client, req, cancel

    def finish(self, destination):
        return self.client.prefill(replace(self.req, destination=destination), self.cancel_)

    def cancel(self):
        pass


class Tok:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def setup(workers, fail=None, finished=(), policy="round_robin", max_retries=2, tokenizer=None):
    config = RouterConfig(policy=policy, max_retries=max_retries)
    pol = make_policy(config)
    reg = Registry(5.0, [pol])
    log = []
    clients = {}
    for wid in workers:
        role = Role.PREFILL if wid.startswith("p") else Role.DECODE
        reg.register(WorkerInfo(wid, role, f"h:{wid}"))
        clients[wid] = FakeClient(wid, log, (fail or {}).get(wid), wid in finished)
    orch = Orchestrator(config, reg, pol, lambda v: clients[v.worker_id], tokenizer)
    return orch, log, reg


def run(orch, prompt=(5, 6), **kw):
    inp = GenerateInput("r1", prompt_ids=prompt, sampling=SamplingParams(**kw))
    return list(orch.generate(inp, Cancellation()))


def test_happy_path_streams_first_token_then_decode_and_summary_last():
    orch, log, reg = setup(["p0", "d0"])
    chunks = run(orch)
    assert [c.token_ids for c in chunks] == [(7,), (8,), (9,)]
    assert [c.summary is None for c in chunks] == [True, True, False]
    s = chunks[-1].summary
    assert (s.finish_reason, s.prompt_tokens, s.cached_tokens, s.retries) == (
        FinishReason.LENGTH,
        2,
        3,
        0,
    )
    assert (s.prefill_worker, s.decode_worker) == ("p0", "d0")
    assert [m for _, m, _ in log] == ["reserve", "prefill", "decode"]
    assert reg.get("p0").inflight == reg.get("d0").inflight == 0


def test_a_burst_routed_at_once_spreads_over_least_loaded_workers():
    """8 requests all routed before any of them starts (each waits in `shipper.wait_for`
    until all 8 are there): each pick counts on its pair at once, so the next sees it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    orch, _, reg = setup(["p0", "p1", "d0", "d1"], policy="least_loaded")
    routed = threading.Barrier(8, timeout=10)
    wait_for = orch.shipper.wait_for

    def held(prefill, prompt):
        routed.wait()
        return wait_for(prefill, prompt)

    orch.shipper.wait_for = held
    with ThreadPoolExecutor(8) as pool:
        summaries = list(pool.map(lambda i: run(orch, prompt=(i, 6))[-1].summary, range(8)))
    assert sorted(s.decode_worker for s in summaries) == ["d0"] * 4 + ["d1"] * 4
    assert sorted(s.prefill_worker for s in summaries) == ["p0"] * 4 + ["p1"] * 4
    assert [reg.get(w).inflight for w in ("p0", "p1", "d0", "d1")] == [0, 0, 0, 0]


def test_failure_before_first_token_retries_on_another_pair_and_aborts_the_first():
    err = WorkerFailed("p0", "Prefill", "UNAVAILABLE: down")
    orch, log, _ = setup(["p0", "p1", "d0", "d1"], fail={"p0": {"prefill": err}})
    chunks = run(orch)
    s = chunks[-1].summary
    assert (s.prefill_worker, s.decode_worker, s.retries) == ("p1", "d1", 1)
    key = worker_key(log)
    assert log[:5] == [
        ("d0", "reserve", key),
        ("p0", "prefill", key),
        ("p0", "abort", key),
        ("d0", "abort", key),
        # the retry has its own id on the workers, so stale events of attempt 1 cannot hit it
        ("d1", "reserve", f"{key}~retry1"),
    ]
    assert all(c.request_id == "r1" for c in chunks)


def worker_key(log) -> str:
    """The request's key on the workers: the router's own, never the client's label."""
    key = log[0][2]
    assert re.fullmatch(r"[0-9a-f]{32}", key), key
    return key


def test_the_client_id_is_a_label_two_requests_with_it_have_two_keys():
    orch, log, _ = setup(["p0", "d0"])
    a, b = run(orch, prompt=(5, 6)), run(orch, prompt=(9,))
    assert [c.request_id for c in a + b] == ["r1"] * 6
    assert [c.token_ids for c in b] == [(10,), (11,), (12,)]
    keys = [rid for _, m, rid in log if m == "reserve"]
    assert len(set(keys)) == 2 and "r1" not in keys
    assert [m for _, m, _ in log] == ["reserve", "prefill", "decode"] * 2


def test_failed_worker_is_excluded_even_if_policy_would_pick_it_again():
    err = WorkerFailed("d0", "Reserve", "UNAVAILABLE")
    orch, log, _ = setup(["p0", "d0", "d1"], fail={"d0": {"reserve": err}}, policy="least_loaded")
    assert run(orch)[-1].summary.decode_worker == "d1"
    assert [(w, m) for w, m, _ in log if m == "reserve"] == [("d0", "reserve"), ("d1", "reserve")]


def test_retries_stop_at_max_retries_with_every_failure_named():
    fail = {w: {"prefill": WorkerFailed(w, "Prefill", "boom")} for w in ("p0", "p1", "p2")}
    orch, log, _ = setup(["p0", "p1", "p2", "d0"], fail=fail, max_retries=1)
    with pytest.raises(NoWorkersError, match="failed on 2 worker pairs.*p0.*p2"):
        run(orch)
    assert [w for w, m, _ in log if m == "prefill"] == ["p0", "p2"]  # round robin turn 2


def test_no_retry_when_only_failed_workers_remain():
    fail = {"p0": {"prefill": WorkerFailed("p0", "Prefill", "boom")}}
    orch, _, _ = setup(["p0", "d0"], fail=fail)
    with pytest.raises(NoWorkersError, match="no prefill worker available .1 live, all failed"):
        run(orch)


def test_worker_invalid_argument_passes_through_without_retry():
    fail = {"p0": {"prefill": InvalidRequestError("prompt has 9000 tokens; max_model_len is 4096")}}
    orch, log, _ = setup(["p0", "p1", "d0"], fail=fail)
    with pytest.raises(
        InvalidRequestError, match="^prompt has 9000 tokens; max_model_len is 4096$"
    ):
        run(orch)
    assert [(w, m) for w, m, _ in log] == [
        ("d0", "reserve"),
        ("p0", "prefill"),
        ("p0", "abort"),
        ("d0", "abort"),
    ]


def test_decode_failure_after_first_token_aborts_both_and_moves_the_request():
    fail = {"d0": {"decode_mid": WorkerFailed("d0", "Decode", "UNAVAILABLE")}}
    orch, log, reg = setup(["p0", "p1", "d0", "d1"], fail=fail)
    chunks = list(orch.generate(GenerateInput("r1", prompt_ids=(5,)), Cancellation()))
    # 6 from p0, 7 from d0 before it failed; then prompt (5, 6, 7) on a new pair: 8, 9, 10
    assert [c.token_ids for c in chunks] == [(6,), (7,), (8,), (9,), (10,)]
    key = worker_key(log)
    assert [(w, m, r) for w, m, r in log if m in ("reserve", "abort")] == [
        ("d0", "reserve", key),
        ("p0", "abort", key),
        ("d0", "abort", key),
        ("d1", "reserve", f"{key}~move1"),
    ]
    summary = chunks[-1].summary
    assert (summary.prompt_tokens, summary.cached_tokens, summary.decode_worker,
            summary.retries) == (1, 3, "d1", 1)
    assert reg.get("d0").inflight == 0 and reg.get("d1").inflight == 0


def test_decode_failure_with_no_other_decode_worker_raises_after_the_tokens_sent():
    fail = {"d0": {"decode_mid": WorkerFailed("d0", "Decode", "UNAVAILABLE")}}
    orch, log, reg = setup(["p0", "d0"], fail=fail)
    got = []
    with pytest.raises(WorkerFailed, match="moving the request failed: no decode worker "
                                           "available"):
        for chunk in orch.generate(GenerateInput("r1", prompt_ids=(5,)), Cancellation()):
            got.append(chunk.token_ids)
    assert got == [(6,), (7,)]
    assert reg.get("d0").inflight == 0


def test_closing_the_stream_early_aborts_both_workers():
    orch, log, reg = setup(["p0", "d0"])
    stream = orch.generate(GenerateInput("r1", prompt_ids=(5,)), Cancellation())
    next(stream)
    stream.close()
    key = worker_key(log)
    assert log[-2:] == [("p0", "abort", key), ("d0", "abort", key)]
    assert reg.get("p0").inflight == 0


@pytest.mark.parametrize("after", [1, 2])
def test_a_stopped_answer_ends_with_its_summary_and_both_workers_aborted(after):
    """`cancel.stop()` (an HTTP stop string) after the first token or in the decode stream:
    the workers are aborted as for a cancel, but the stream ends with a STOP summary naming
    the cached tokens and the workers; `cancel.cancel()` ends it with RequestCancelled."""
    orch, log, reg = setup(["p0", "d0"])
    cancel = Cancellation()
    stream = orch.generate(GenerateInput("r1", prompt_ids=(5, 6)), cancel)
    got = [next(stream) for _ in range(after)]
    cancel.stop()
    (last,) = list(stream)
    assert [c.token_ids for c in got] == [(7,), (8,)][:after] and last.token_ids == ()
    assert last.text == "" and all(c.summary is None for c in got)
    s = last.summary
    assert (s.finish_reason, s.prompt_tokens, s.cached_tokens, s.prefill_worker,
            s.decode_worker, s.retries) == (FinishReason.STOP, 2, 3, "p0", "d0", 0)
    key = worker_key(log)
    decoded = [("d0", "decode", key)] if after == 2 else []  # stopped at the first token:
    assert log[2:] == decoded + [("p0", "abort", key), ("d0", "abort", key)]  # no Decode
    assert reg.get("p0").inflight == reg.get("d0").inflight == 0

    cancel = Cancellation()
    stream = orch.generate(GenerateInput("r2", prompt_ids=(5, 6)), cancel)
    next(stream), next(stream)
    cancel.cancel()
    cancel.stop()  # too late: the client is gone, nobody waits for a summary
    assert not cancel.stopped
    with pytest.raises(RequestCancelled):
        next(stream)


def test_cancelled_during_prefill_aborts_both_and_does_not_retry():
    fail = {"p0": {"prefill": RequestCancelled("cancelled")}}
    orch, log, _ = setup(["p0", "p1", "d0"], fail=fail)
    with pytest.raises(RequestCancelled):
        run(orch)
    assert [(w, m) for w, m, _ in log] == [
        ("d0", "reserve"),
        ("p0", "prefill"),
        ("p0", "abort"),
        ("d0", "abort"),
    ]


def test_a_reservation_made_after_the_cancels_abort_is_aborted_too():
    """The client cancels while Reserve is on its way: the cancel's Abort reaches the decode
    worker first and finds nothing, then Reserve makes the reservation. It is aborted once
    Reserve returned (before, it stayed held until its lease ran out, 30 s by default)."""
    orch, log, _ = setup(["p0", "d0"])
    cancel = Cancellation()
    decode = orch.clients(orch.registry.get("d0"))
    held = set()

    def reserve(req, c):
        log.append(("d0", "reserve", req.request_id))
        cancel.cancel()  # the background Abort runs now, while Reserve is still "on its way"
        deadline = time.monotonic() + 5
        while ("d0", "abort", req.request_id) not in log and time.monotonic() < deadline:
            time.sleep(0.001)
        held.add(req.request_id)  # ... and then the worker reserves
        return Reservation("d0", "tcp://x", (0, 1), 0)

    def abort(rid):
        log.append(("d0", "abort", rid))
        found = rid in held
        held.discard(rid)
        return found

    decode.reserve, decode.abort = reserve, abort
    with pytest.raises(RequestCancelled):
        list(orch.generate(GenerateInput("r1", prompt_ids=(5, 6)), cancel))
    assert held == set()
    assert [m for w, m, _ in log if w == "d0"] == ["reserve", "abort", "abort"]


def test_first_token_that_finishes_releases_the_reservation():
    orch, log, _ = setup(["p0", "d0"], finished={"p0"})
    chunks = run(orch)
    assert [c.token_ids for c in chunks] == [(7,)]
    assert chunks[0].summary.finish_reason == FinishReason.STOP
    assert [(w, m) for w, m, _ in log] == [("d0", "reserve"), ("p0", "prefill"), ("d0", "abort")]


def test_no_worker_of_a_role_is_unavailable():
    orch, _, _ = setup(["p0"])
    with pytest.raises(NoWorkersError, match="no decode worker available"):
        run(orch)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"stop_token_ids": (3, -1)}, r"stop_token_ids \[-1\] are outside"),
    ],
)
def test_bad_sampling_is_rejected_before_any_worker_call(kw, message):
    orch, log, _ = setup(["p0", "d0"])
    with pytest.raises(InvalidRequestError, match=message):
        run(orch, **kw)
    assert log == []


@pytest.mark.parametrize(
    "inp, message",
    [
        (GenerateInput("r"), "prompt is empty"),
        (GenerateInput("r", prompt_ids=(1,), prompt_text="hi"), "either prompt or prompt_ids"),
        (GenerateInput("r", prompt_text="hi"), "no tokenizer: send prompt_ids"),
        (GenerateInput("r", prompt_ids=(1, -2)), r"prompt_ids must be >= 0, got \[-2\]"),
    ],
)
def test_bad_prompts_are_rejected(inp, message):
    orch, _, _ = setup(["p0", "d0"])
    with pytest.raises(InvalidRequestError, match=message):
        list(orch.generate(inp, Cancellation()))


def test_text_prompt_is_tokenized_and_text_deltas_streamed():
    orch, _, _ = setup(["p0", "d0"], tokenizer=Tok())
    chunks = list(orch.generate(GenerateInput("r", prompt_text="ab"), Cancellation()))
    assert [c.token_ids for c in chunks] == [(99,), (100,), (101,)]
    assert "".join(c.text for c in chunks) == "cde"
    assert chunks[-1].summary.prompt_tokens == 2


def test_all_decode_workers_full_queues_until_cancel_or_timeout():
    import threading

    busy = WorkerBusy("d0", "Reserve", "decode worker is full (1 requests)")
    config = RouterConfig(max_queued_requests=4, queue_timeout_s=0.3)
    pol = make_policy(config)
    reg = Registry(5.0, [pol])
    log = []
    clients = {w: FakeClient(w, log, {"reserve": busy} if w == "d0" else None)
               for w in ("p0", "d0")}
    for wid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
        reg.register(WorkerInfo(wid, role, f"h:{wid}"))
    orch = Orchestrator(config, reg, pol, lambda v: clients[v.worker_id])
    with pytest.raises(CapacityError, match=r"waited 0.3s in the router queue"):
        list(orch.generate(GenerateInput("r1", prompt_ids=(5,)), Cancellation()))
    tries = [m for _, m, _ in log]
    assert set(tries) == {"reserve"} and 3 <= len(tries) <= 8  # retried every RETRY_S
    cancel = Cancellation()
    threading.Timer(0.1, cancel.cancel).start()
    with pytest.raises(RequestCancelled, match="cancelled while queued"):
        list(orch.generate(GenerateInput("r2", prompt_ids=(5,)), cancel))
    assert orch.queue.waiting == 0 and reg.get("d0").inflight == 0


class EuroTok:
    """Ids 7, 8, 9 are the three bytes of '€': the answer's only character spans all chunks."""

    BYTES = {7: 0xE2, 8: 0x82, 9: 0xAC}

    def encode(self, text):
        raise AssertionError("prompt_ids only")

    def decode(self, ids):
        return bytes(self.BYTES.get(i, 0x3F) for i in ids).decode("utf-8", errors="replace")


def test_a_character_split_across_chunks_is_sent_whole_once_complete():
    orch, _, _ = setup(["p0", "d0"], tokenizer=EuroTok())
    chunks = run(orch, prompt=(5, 6))
    assert [c.token_ids for c in chunks] == [(7,), (8,), (9,)]
    assert [c.text for c in chunks] == ["", "", "€"]
