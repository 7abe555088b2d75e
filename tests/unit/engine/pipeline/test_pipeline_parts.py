"""Pipeline pieces without processes: micro-batch splits, mirrored cache operations, and how a
stage-0 facade joins per-stage transfer events (one failed stage fails the request)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from baton.engine.pipeline.mirror import MirroredPools, apply_ops
from baton.engine.pipeline.model import PipelineModel, split, token_split
from baton.model.nemotron_h.config import ModelConfig
from baton.model.nemotron_h.make import checkpoint_config
from baton.model.pools import Pools, PoolSpec
from baton.worker.staged import StagedAgent

CFG = ModelConfig.from_dict(checkpoint_config("tiny", pattern="MMM*-M*-"))


def _pools(layers):
    return Pools(PoolSpec.for_model(CFG, num_blocks=8, tokens_per_block=16, num_slots=4,
                                    layers=layers))


def test_split_gives_contiguous_nearly_equal_micro_batches():
    assert split(5, 2) == [range(0, 3), range(3, 5)]
    assert split(2, 8) == [range(0, 1), range(1, 2)]
    assert split(7, 1) == [range(0, 7)]


def test_token_split_keeps_ranges_at_scan_chunks_and_at_least_the_minimum():
    assert token_split(512, 2, 128) == [range(0, 256), range(256, 512)]
    # 3 asked, 4 divide the 4 chunks evenly
    assert token_split(512, 3, 128) == [range(0, 128), range(128, 256), range(256, 384),
                                        range(384, 512)]
    assert token_split(100, 4, 32) == [range(0, 100)]  # under two minimum ranges: whole
    assert token_split(256, 8, 128) == [range(0, 128), range(128, 256)]
    assert token_split(500, 2, 128) == [range(0, 256), range(256, 500)]
    assert token_split(1024, 1, 32) == [range(0, 1024)]


def test_plan_splits_tokens_only_when_a_prefill_has_too_few_sequences():
    pm = PipelineModel.__new__(PipelineModel)
    pm.config, pm.min_tokens, pm.token_split_forwards = CFG, 128, 0  # tiny: scan chunk 32
    # 2 sequences, 8 micro-batches wanted: each sequence's 512 tokens in 4 ranges, in order
    plan = pm.plan(2, 512, 8, decode=False)
    assert plan == [(g, range(a, a + 128)) for a in (0, 128, 256, 384)
                    for g in (range(0, 1), range(1, 2))]
    # enough sequences, or a decode: by sequence only
    assert pm.plan(8, 512, 8, decode=False) == [(range(i, i + 1), range(0, 512)) for i in range(8)]
    assert pm.plan(2, 1, 8, decode=True) == [(range(0, 1), range(0, 1)), (range(1, 2), range(0, 1))]
    # a short chunk stays whole
    assert pm.plan(1, 64, 8, decode=False) == [(range(0, 1), range(0, 64))]


def test_mirrored_operations_replay_on_a_stage_in_order():
    stage0 = MirroredPools(_pools(None).spec, _pools(range(0, 3)))  # attention-free stage 0
    assert stage0.has_kv and stage0.has_state and not stage0.local.has_kv
    stage1 = _pools(range(3, 6))
    stage1.kv.normal_()
    stage1.conv.normal_()
    stage1.ssm.normal_()
    want = [t.clone() for t in (stage1.kv, stage1.conv, stage1.ssm)]
    stage0.copy_block(2, 5)
    stage0.copy_slot(1, 3)
    stage0.zero_slot(1)
    ops = stage0.take_ops()
    assert ops == [("block", 2, 5), ("slot", 1, 3), ("zero", 1, 0)] and stage0.take_ops() == []
    apply_ops(stage1, ops)
    want[0][:, 5] = want[0][:, 2]
    want[1][:, 3], want[2][:, 3] = want[1][:, 1], want[2][:, 1]
    want[1][:, 1], want[2][:, 1] = 0, 0
    for got, exp in zip((stage1.kv, stage1.conv, stage1.ssm), want, strict=True):
        assert torch.equal(got, exp)


class _Agent:
    def __init__(self, events=()):
        self.events, self.aborted = list(events), []

    def poll(self):
        out, self.events = self.events, []
        return out

    def poll_interval(self):
        return None

    def abort(self, rid, reason):
        self.aborted.append(rid)


class _Model:
    """A `protocol.StagedLM` stand-in: 3 stages, each with a transfer agent."""

    size = agents = 3

    def __init__(self):
        self.replies = {1: [], 2: []}
        self.calls = []

    def call(self, name, args_of, reply):
        self.calls.append((name, args_of(1)))
        if name != "poll":
            return []
        out = [{"events": self.replies[k]} for k in (1, 2)]
        self.replies = {1: [], 2: []}
        return out


def _agent(local):
    model = _Model()
    loop = SimpleNamespace(engine=SimpleNamespace(model=model), call=lambda fn, *a: fn(*a))
    ev = SimpleNamespace
    agent = StagedAgent(loop, local, lambda rid, ok, err: ev(request_id=rid, ok=ok, error=err))
    return agent, model


def test_a_request_lands_only_when_every_stage_reported():
    local = _Agent()
    agent, model = _agent(local)
    agent.track("r")
    local.events = [SimpleNamespace(request_id="r", ok=True, error=None)]
    model.replies[1] = [["r", True, None]]
    assert agent.poll() == [] and agent.poll_interval() is not None
    model.replies[2] = [["r", True, None]]
    (ev,) = agent.poll()
    assert (ev.request_id, ev.ok) == ("r", True)
    assert agent.poll_interval() is None and agent.poll() == []


def test_one_failed_stage_fails_the_request_and_aborts_it_everywhere():
    local = _Agent()
    agent, model = _agent(local)
    agent.track("r")
    model.replies[1] = [["r", True, None]]
    model.replies[2] = [["r", False, "lease expired"]]
    (ev,) = agent.poll()
    assert (ev.request_id, ev.ok) == ("r", False) and "stage 2: lease expired" in ev.error
    assert local.aborted == ["r"]
    assert ("abort", {"rid": "r", "reason": "stage 2: lease expired"}) in model.calls
    local.events = [SimpleNamespace(request_id="r", ok=True, error=None)]
    assert agent.poll() == []  # a late report of the failed request is dropped


def test_a_decode_stage_refusing_a_reservation_frees_it_on_every_stage_and_the_engine():
    from decode_worker.pipeline import PipelineReceiver

    class Model(_Model):
        size = 2

        def call(self, name, args_of, reply):
            self.calls.append((name, args_of(1)))
            if name == "init":
                return [{"ok": True, "endpoint": "tcp://h:2"}]
            if name == "expect":
                return [{"ok": False, "error": "TransferError: already expected"}]
            return []

    local = _Agent()
    local.incarnation, local.endpoint, local.expected = "inc", "tcp://h:1", []
    local.expect = lambda rid, blocks, slot, lease: local.expected.append(rid)
    aborted = []
    engine = SimpleNamespace(model=Model(), abort=aborted.append)
    loop = SimpleNamespace(engine=engine, call=lambda fn, *a: fn(*a))
    rx = PipelineReceiver(loop, local, lambda *a: a)
    assert rx.endpoint == "tcp://h:1,tcp://h:2"
    assert ("init", {"incarnation": "inc"}) in engine.model.calls
    try:
        rx.expect("r", [3, 4], 1, 30.0)
        raise AssertionError("expect must fail")
    except RuntimeError as e:
        assert "a decode stage refused r" in str(e)
    assert local.expected == ["r"] and local.aborted == ["r"] and aborted == ["r"]
    assert engine.model.calls[-1] == ("abort", {"rid": "r", "reason": "reservation failed"})
    assert rx.poll_interval() is None  # nothing left tracked


def test_a_stage_loads_exactly_its_tensors_tied_head_included(tmp_path):
    from baton.model.loader import load_model, load_stage
    from baton.model.make_model import write_checkpoint

    path = write_checkpoint(tmp_path / "tied", pattern="MMM*-M*-", tie_word_embeddings=True)
    full = dict(load_model(path).named_parameters())
    full["lm_head.weight"] = full["backbone.embeddings.weight"]  # tied: listed once in full
    last = load_stage(path, range(6, 8), first=False, last=True)
    got = dict(last.named_parameters())
    want = {n for n in full if n.startswith(("backbone.layers.6.", "backbone.layers.7.",
                                              "backbone.norm_f.", "lm_head."))}
    assert set(got) == want
    assert all(torch.equal(got[n], full[n]) for n in want)
    first = load_stage(path, range(0, 3), first=True, last=False)
    assert {n.split(".")[1] for n in dict(first.named_parameters())} == {"layers", "embeddings"}


def test_concurrent_askers_of_a_failed_reservation_get_the_one_quarantine_the_release_names():
    """A reservation's abort (asking on the loop) and its transfer's failure (the events
    thread) ask for its quarantine at once: both must get the same one, or the cache holds a
    key that no release ever names and its block and slot leak (seen in the PP cluster test);
    and neither may wait for the other while the other waits for the loop (a lock of its own
    did: the events thread held it, waiting for the loop to reach the stages, while the loop
    waited for it)."""
    import threading

    from baton.engine.loop import EngineLoop
    from decode_worker.pipeline import PipelineReceiver

    class Model(_Model):
        size = 2

        def call(self, name, args_of, reply):
            if name == "init":
                return [{"ok": True, "endpoint": "tcp://h:2"}]
            if name == "held":
                time.sleep(0.2)  # a stage's answer takes a round trip: both askers wait here
                return [{"key": "r", "blocks": [3], "slot": 1}]
            return []

    local = _Agent()
    local.incarnation, local.endpoint = "inc", "tcp://h:1"
    local.held = lambda rid: None
    loop = EngineLoop(SimpleNamespace(model=Model(), has_work=False))  # no requests: calls only
    rx = PipelineReceiver(loop, local, lambda *a: a)
    released = []
    rx.on_release = released.append
    got = []

    def abort_on_loop():  # the loop is busy a moment, then asks (Engine.quarantine's hold)
        time.sleep(0.1)
        got.append(rx.held("r"))

    askers = [threading.Thread(target=lambda: loop.call(abort_on_loop)),
              threading.Thread(target=lambda: (time.sleep(0.05), got.append(rx.held("r"))))]
    for t in askers:
        t.start()
    for t in askers:
        t.join(timeout=15)
    assert not any(t.is_alive() for t in askers), "deadlocked"
    loop.stop()
    assert len(got) == 2 and got[0] is got[1], [q.key for q in got]
    assert got[0].blocks == frozenset({3}) and got[0].slot == 1
    rx.stage_reply(1, {"released": ["r"]})
    assert released == [got[0].key]
