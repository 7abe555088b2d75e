"""bf16 state with stochastic rounding under pipeline and tensor parallelism
(docs/state-precision.md): stage 0 / rank 0 rounds its layers and records the rounding as a
mirrored pool operation that every other stage / rank applies to its own layers, keyed by the
global layer id and, on a TP rank, by each element's index in the whole (TP 1) tensor.

PP 2 gives the colocated engine's tokens and logprobs bit for bit (the same arithmetic, split
over processes); TP 2 gives TP 1's greedy tokens on prompts whose TP 1 margins are clear (TP
reductions differ in the last bits, as with float32 state), and its ranks' state equals the
TP 1 state's shards to bf16 ulps; both with prefix reuse at prompt-internal points and
snapshots stored in bf16 on every stage / rank."""

from __future__ import annotations

import pytest
import torch

from baton.engine.request import Request
from baton.model.loader import load_model
from baton.model.partition import partition_layers
from tests.integration.test_tp_engine import MARGIN, greedy_margins
from tests.support.engine_helpers import engine_for, greedy, make_checkpoint, prompt, run_all

pytestmark = pytest.mark.integration

SR = {"state_dtype": "bfloat16", "state_rounding": "stochastic", "state_rounding_seed": 11,
      "tokens_per_block": 16,
      "mamba_state_config": {"periodic_snapshot_interval": 16, "decode_end_snapshot": False}}
WORKER = {"prefill_chunk_size": 32, "max_batch_tokens": 96}
LENGTHS = [5, 17, 40, 70]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("sr-par"), pattern="MM*-M*-M", seed=5)


@pytest.fixture(scope="module")
def threads():
    mp = pytest.MonkeyPatch()
    mp.setenv("BATON_NUM_THREADS", "1")  # one torch thread per process on 2 cores
    yield
    mp.undo()


def _reqs(tag: str, prompts: list[list[int]]) -> list[Request]:
    """Each prompt, then it again extended: the second reuses a periodic (prompt-internal)
    snapshot."""
    first = [Request(f"{tag}{i}", p, greedy(6, logprobs=1)) for i, p in enumerate(prompts)]
    return first + [Request(f"{tag}x{i}", p + prompt(50 + i, 9), greedy(6, logprobs=1))
                    for i, p in enumerate(prompts)]


def _run(eng, tag: str, prompts):
    out = run_all(eng, _reqs(tag, prompts))
    lps = {k[len(tag):]: [lp.logprob for lp in o.logprobs]  # (its last output's)
           for k, o in out["outputs"].items()}
    toks = {k[len(tag):]: v for k, v in out["tokens"].items()}
    cached = {k[len(tag):]: o.cached_tokens for k, o in out["outputs"].items()}
    return toks, lps, cached


def _close(eng):
    procs = eng.model.local_stages.procs
    eng.model.close()
    assert all(p.poll() is not None for p in procs.values())


def test_pipeline_2_equals_colocated_bit_for_bit(model_dir, threads):
    prompts = [prompt(i, n) for i, n in enumerate(LENGTHS)]
    ref_eng = engine_for(model_dir, worker=WORKER, cache=SR)
    assert ref_eng.rounding is not None
    ref = _run(ref_eng, "c", prompts)
    pp = engine_for(model_dir, worker={**WORKER, "pipeline_parallel_size": 2}, cache=SR)
    try:
        assert pp.rounding is not None and pp.pools.local.snapshots  # bf16 snapshot pools
        got = _run(pp, "p", prompts)
        pp.cache.check_integrity()
    finally:
        _close(pp)
    assert got == ref  # tokens, logprobs and cached tokens
    assert sum(ref[2].values()) > 0
    plain = _run(engine_for(model_dir, worker=WORKER, cache={**SR, "state_dtype": "model",
                                                             "state_rounding": "nearest"}),
                 "f", prompts)
    assert plain[1] != ref[1]  # float32 state gives other logprobs: the rounding is real


@pytest.mark.parametrize("pp, kv", [(1, "model"), (2, "float8_e4m3")],
                         ids=["tp2", "tp2xpp2-fp8kv"])
def test_tensor_parallel_2_equals_tp1(model_dir, threads, pp, kv):
    """Also TP 2 x PP 2 (with fp8 KV besides, against TP 1 with fp8 KV): every world rank
    splits its pools alike and applies the mirrored round op to its stage's layers, keyed by
    global layer and TP 1 index."""
    ref_model = load_model(model_dir)
    prompts = []
    for i, n in enumerate(LENGTHS * 2):
        p = prompt(100 + i, n)
        if min(m for _, _, m in greedy_margins(ref_model, p, 6)[1]) >= MARGIN:
            prompts.append(p)
    assert len(prompts) >= 3
    cache = {**SR, "kv_dtype": kv}
    ref_eng = engine_for(model_dir, worker=WORKER, cache=cache)
    ref = _run(ref_eng, "c", prompts)
    tp = engine_for(model_dir, worker={**WORKER, "tensor_parallel_size": 2,
                                       "pipeline_parallel_size": pp}, cache=cache)
    try:
        assert tp.rounding is not None and tp.rounding.index
        assert tp.pools.local.spec.kv_store_dtype.itemsize == (1 if pp > 1 else 4)
        got = _run(tp, "t", prompts)
        tp.cache.check_integrity()
        # TP 2: rank 1; TP 2 x PP 2: stage 1's TP rank 1 (world order: stage 1's leader, its
        # TP rank 1, stage 0's TP rank 1)
        shard = _rank1_snapshot(tp, prompts[-1], 0 if pp == 1 else 1)
    finally:
        _close(tp)
    assert got[0] == ref[0] and got[2] == ref[2]  # tokens, and the same reuse
    # rank 1's shard of the snapshot at 16 tokens is TP 1's, element for element, but for
    # the few that TP's float32 sums put on the other side of a draw (keyed by the shard's
    # local index instead, a third of them would differ)
    from baton.engine.state_rounding import tp1_index

    snap = ref_eng.cache.tree.match(prompts[-1], 16).snapshot
    layers = ref_eng.pools.spec.state_layers
    rows = [i for i, g in enumerate(layers) if pp == 1 or g in partition_layers(8, pp)[-1]]
    for spec in ref_eng.pools.spec.state_tensors:
        whole = ref_eng.pools.slot(spec.name, snap.slot).float().flatten(1)[rows]
        want = whole[:, tp1_index(spec, 2, 1).flatten()]
        got_t = shard[spec.name].view(want.shape)
        same = (got_t == want).float().mean().item()
        assert same > 0.99, (spec.name, same)


def _rank1_snapshot(eng, p: list[int], which: int) -> dict[str, torch.Tensor]:
    """Reply `which`'s (a TP rank 1's) bytes of the snapshot at 16 tokens of prompt `p`, per
    state tensor."""
    slot = eng.cache.tree.match(p, 16).snapshot.slot
    reply = eng.model.call("tp_dump_slot", lambda k: {"slot": slot})[which]
    assert slot >= eng.pools.spec.num_slots  # in the ranks' bf16 snapshot pools
    return {n: torch.frombuffer(bytearray(b), dtype=torch.bfloat16).float()
            for n, b in reply["state"].items()}


def test_pipeline_2_speculation_equals_colocated_off(tmp_path, threads):
    """PP 2 with speculation (K=3, the MTP head on the last stage) and rounded state gives the
    colocated engine's tokens without speculation, and the logprobs of the last turn (which
    restores the speculated decode-end snapshot) bit for bit, over a chat whose turns restore
    periodic and decode-end snapshots."""
    from tests.support.speculative_helpers import agreeing_checkpoint
    from tests.unit.engine.test_state_rounding import SR as SR3
    from tests.unit.engine.test_state_rounding import run_until_done

    ck = agreeing_checkpoint(tmp_path)
    policy = {"periodic_snapshot_interval": 16, "decode_end_snapshot": True}

    def chat(k: int, pp: int):
        eng = engine_for(ck, speculative={"num_draft_tokens": k},
                         worker={"max_num_seqs": 4, "pipeline_parallel_size": pp},
                         cache={"tokens_per_block": 16, "num_state_slots": 32,
                                "mamba_state_config": policy, **SR3})
        history, turns = [], []
        try:
            for t in range(4):
                p = history + prompt(200 + t, 7 + 6 * t)
                eng.add_request(Request(f"t{t}", p, greedy(12, logprobs=1 if t == 3 else None)))
                turns.append(run_until_done(eng, f"t{t}"))
                history = p + turns[-1][0]
            if pp > 1:
                assert eng.spec.accepted_tokens > 0
                eng.cache.check_integrity()
        finally:
            if pp > 1:
                _close(eng)
        return turns

    off = chat(0, 1)
    assert chat(3, 2) == off
    assert [c for _, _, c in off][1:] == [19, 44, 75]  # every later turn restored a snapshot
