"""MTP speculative decoding in the colocated engine, on NemotronH (dense `*-` MTP block; MoE
layers with a MoE `*E` block) and Qwen3.5 (its gated-attention MTP layer): greedy output
identical to speculation off at every K, on the default (fast) decode path and on the
reference path, acceptance really happens, and the rolled-back state equals a recompute."""

from __future__ import annotations

import random

import pytest
import torch

from baton.contract import FinishReason
from baton.engine.request import Request, SamplingParams
from tests.support.engine_helpers import engine_for, greedy, prompt, run_all
from tests.support.speculative_helpers import agreeing_checkpoint, agreeing_qwen_checkpoint
from tests.support.trained import NAMES, shipped

pytestmark = pytest.mark.usefixtures("model_single_thread")


@pytest.fixture(scope="module", params=["nemotron_h", "nemotron_h_moe", "qwen3_5", *NAMES])
def agree_dir(request, tmp_path_factory):
    """A tiny model of each family whose MTP head agrees with it about a third of the time
    (NemotronH with a dense `*-` head, NemotronH with MoE layers and a MoE `*E` head), and the
    trained models with their trained heads where they are shipped."""
    if request.param in NAMES:
        return shipped(request.param)
    root = tmp_path_factory.mktemp(f"spec_{request.param}")
    if request.param == "nemotron_h_moe":
        return agreeing_checkpoint(root, pattern="M*MEM*ME")
    make = agreeing_checkpoint if request.param == "nemotron_h" else agreeing_qwen_checkpoint
    return make(root)


N_REQUESTS = 54
TREE = {"top_k": [3, 2, 2], "max_total_draft_tokens": 8}


def _sampled(i: int) -> bool:
    return i % 9 == 5


def _workload(stops: dict[str, int]) -> list[Request]:
    """54 requests, prompts of 1..2000 tokens at concurrency 8: groups extending one another's
    prompts (prefix hits on prompt-end snapshots), 6 seeded sampled requests and 6 greedy
    ones asking for logprobs (they do not speculate: one token a step through the sampler,
    in the same batches) mixed in, max_tokens from 1 up, stop tokens from `stops`. The 48
    greedy ones must match speculation off token for token."""
    rng = random.Random(7)
    lengths = [1, 2, 3, 5, 9, 17, 31, 64, 100, 250, 600, 2000]
    reqs = []
    for i in range(N_REQUESTS):
        base = [rng.randrange(3, 512) for _ in range(lengths[i % 12])]
        if i >= 12 and i % 3 == 0:  # extends an earlier request's prompt: a prefix hit
            base = reqs[i - 12].prompt_ids + base[:9]
        rid = f"r{i:02d}"
        n = [1, 2, 4, 7, 16, 33][i % 6]
        stop = (stops[rid],) if rid in stops else ()
        if _sampled(i):
            s = SamplingParams(max_tokens=n, temperature=0.8, seed=i)
        elif i % 8 == 1:
            s = greedy(n, stop_token_ids=stop, logprobs=1)
        else:
            s = greedy(n, stop_token_ids=stop)
        reqs.append(Request(rid, base[:2000], s))
    return reqs


def _run(model_dir, k, stops: dict[str, int]):
    spec, cache = {"num_draft_tokens": k}, {}
    if k == "tree":  # 8 nodes x 8 requests kept for the verify pass, the rest for snapshots
        spec, cache = {"num_draft_tokens": 3, "tree": TREE}, {"num_state_slots": 128}
    eng = engine_for(model_dir, worker={"max_num_seqs": 8, "prefill_chunk_size": 256},
                     speculative=spec, cache=cache)
    out = run_all(eng, _workload(stops))
    return eng, out


@pytest.fixture(scope="module")
def reference(agree_dir):
    return _reference(agree_dir)


def _reference(agree_dir):
    """Speculation off; stop tokens picked from its own greedy answers (a token inside
    each); with them the answers are these cut after the stop token's first occurrence (a
    stop only ends a greedy answer)."""
    _, plain = _run(agree_dir, 0, {})
    stops = {rid: toks[len(toks) // 2] for rid, toks in plain["tokens"].items()
             if len(toks) >= 4 and int(rid[1:]) % 2 == 0 and not _sampled(int(rid[1:]))}
    off = {}
    for rid, toks in plain["tokens"].items():
        if rid in stops:
            cut = toks.index(stops[rid]) + 1
            off[rid] = (toks[:cut], FinishReason.STOP)
        else:
            off[rid] = (toks, plain["outputs"][rid].finish_reason)
    return stops, off


TRAINED_KS = (3, "tree")
"""What the trained models run of the greedy identity tests: the workload costs them 10-50 s a
K on a 2-core CPU; K = 1, 5 and the reference path run on the agreeing tiny models."""


def _trained_runs(agree_dir, what) -> None:
    if agree_dir.name in NAMES and what not in TRAINED_KS:
        pytest.skip(f"{what!r} runs on the agreeing tiny models (the trained ones run "
                    f"{TRAINED_KS}: suite time)")


@pytest.mark.parametrize("k", [1, 3, 5, "tree"])
def test_greedy_identical_to_speculation_off(agree_dir, reference, k):
    _trained_runs(agree_dir, k)
    _assert_identical(agree_dir, reference, k)


def _assert_identical(agree_dir, reference, k):
    stops, off = reference
    eng, on = _run(agree_dir, k, stops)
    sampled = {r.id for r in _workload(stops) if not r.sampling.greedy}
    assert len(sampled) == 6 and len(off) - len(sampled) == 48
    for rid, (toks, reason) in off.items():
        if rid not in sampled:  # sampled ones speculate too, by the rejection rule
            assert on["tokens"][rid] == toks, rid
            assert on["outputs"][rid].finish_reason == reason, rid
    # speculation really ran: drafts were made and some were accepted, some rejected
    assert eng.spec.accepted_tokens > 0
    assert eng.spec.draft_tokens > eng.spec.accepted_tokens
    if k == "tree":  # branches: more nodes than depth, and paths deeper than one accepted
        assert eng.spec.draft_tokens > 3 * sum(eng.spec.accepted_hist)
        assert sum(eng.spec.accepted_hist[2:]) > 0
    hits = sum(o.cached_tokens > 0 for o in on["outputs"].values())
    assert hits > 0
    stopped = [rid for rid in stops if on["tokens"][rid][-1] == stops[rid]]
    assert len(stopped) == len(stops)
    assert eng.tracked()["spec_pending"] == 0
    eng.cache.check_integrity()


def _state(pools, slot: int) -> dict[str, torch.Tensor]:
    return {n: t[:, slot].clone() for n, t in pools.state.items()}


def _kv(pools, layers, table, n: int) -> torch.Tensor:
    """K/V of positions 0..n-1 of the global attention `layers`: [layers, 2, n, heads, dim]."""
    tpb = pools.spec.tokens_per_block
    rows = [pools.kv[pools.spec.attn_index[g]] for g in layers]
    return torch.stack([torch.stack([r[table[p // tpb], :, p % tpb] for p in range(n)], 1)
                        for r in rows])


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_acceptance_counted_and_state_equals_recompute_after_every_verify(agree_dir, tree):
    """One request at K=3 (a chain, or a tree) beside a second one; after every step the live
    state of the first equals that of plain decoding over the tokens it has computed, step
    by step (a tree: its attention KV too, where the kept nodes' rows were moved)."""
    spec = {"num_draft_tokens": 3, **({"tree": TREE} if tree else {})}
    eng = engine_for(agree_dir, worker={"max_num_seqs": 4}, speculative=spec)
    rng = random.Random(3)
    main = Request("a", [rng.randrange(3, 512) for _ in range(37)], greedy(60))
    other = Request("b", [rng.randrange(3, 512) for _ in range(5)], greedy(60))
    eng.add_request(main)
    eng.add_request(other)
    model = eng.model
    ref = model.make_pools(16, eng.pools.spec.tokens_per_block, 1)
    table = list(range(16))
    model.prefill(torch.tensor(main.prompt_ids), 0, table, 0, ref)
    done = main.prompt_len
    accepted_steps = rejected_steps = 0
    while main.phase.value != "finished":
        acc, drafted = eng.spec.accepted_tokens, eng.spec.draft_tokens
        before = main.num_computed
        eng.step()
        if main.phase.value == "finished" or main.num_computed == before:
            continue
        a, d = eng.spec.accepted_tokens - acc, eng.spec.draft_tokens - drafted
        accepted_steps += a > 0
        rejected_steps += d > 0 and a < d
        prev, start = _state(ref, 0), done
        while done < main.num_computed:  # plain decode, one token at a time
            tok = torch.tensor([main.all_ids[done]])
            model.decode(tok, torch.tensor([done]), [table], torch.tensor([0]), ref)
            done += 1
        want, got = _state(ref, 0), _state(eng.pools, eng.cache.slot("a"))
        for name in want:
            assert torch.allclose(got[name], want[name], atol=1e-5, rtol=0), name
            if done > start:  # the check can tell one position from the next
                assert (want[name] - prev[name]).abs().max() > 1e-3
        if tree:
            layers = ref.spec.attn_layers
            assert torch.allclose(_kv(eng.pools, layers, eng.cache.block_table("a"), done),
                                  _kv(ref, layers, table, done), atol=1e-5, rtol=0)
    assert accepted_steps > 3 and rejected_steps > 3
    assert len(main.output_ids) == 60
    while eng.has_work:
        eng.step()


def test_seeded_sampling_with_speculation_is_reproducible(agree_dir):
    def run():
        eng = engine_for(agree_dir, worker={"max_num_seqs": 8},
                         speculative={"num_draft_tokens": 3})
        reqs = [Request(f"s{i}", [7 + i, 30, 11 * i + 3], SamplingParams(
            max_tokens=24, temperature=0.7, seed=100 + i, ignore_eos=True)) for i in range(8)]
        out = run_all(eng, reqs)
        return eng, out["tokens"]

    e1, a = run()
    e2, b = run()
    assert a == b
    assert e1.spec.accepted_tokens == e2.spec.accepted_tokens > 0
    assert e1.spec.draft_tokens > e1.spec.accepted_tokens


def _verify_vs_decode(model, positions: int):
    """(verify logits, plain decode logits per position, pools after each, scratch) for 4
    sequences x `positions` tokens from the same prefilled pools."""
    from baton.engine.speculative.verify import StateScratch, VerifyRow, verify_forward

    lens = [5, 40, 17, 23]
    tables = [[8 * i + j for j in range(8)] for i in range(4)]
    rng = random.Random(0)
    a = model.make_pools(64, 16, 4 + 4 * 3)
    for i, n in enumerate(lens):
        model.prefill(torch.tensor([rng.randrange(3, 512) for _ in range(n)]), 0, tables[i], i, a)
    b = model.make_pools(64, 16, 4 + 4 * 3)
    for x, y in zip(b.tensors, a.tensors, strict=True):
        x.copy_(y)
    toks = [[rng.randrange(3, 512) for _ in range(positions)] for _ in range(4)]
    rows = [VerifyRow(toks[i], lens[i], i, tables[i]) for i in range(4)]
    scratch = StateScratch(a, 4, 4, 3)
    _, logits = verify_forward(model, a, rows, scratch)
    refs, states = [], []
    for j in range(positions):
        refs.append(model.decode(torch.tensor([t[j] for t in toks]),
                                 torch.tensor([n + j for n in lens]), tables,
                                 torch.tensor([0, 1, 2, 3]), b))
        states.append({n: t[:, :4].clone() for n, t in b.state.items()})
    return logits.view(4, positions, -1), refs, states, a, b, scratch


def _assert_verify_equals_decode_bit_for_bit(model) -> None:
    """4 sequences x 4 positions: verify logits and every position's state (scratch slots for
    the first three, the live slot for the last) equal plain decode's bit for bit."""
    logits, refs, states, a, _, scratch = _verify_vs_decode(model, 4)
    for j in range(4):
        assert torch.equal(logits[:, j], refs[j]), j
        for name in a.state:
            for i in range(4):
                got = a.state[name][:, scratch.slot(i, j)] if j < 3 else a.state[name][:, i]
                assert torch.equal(got, states[j][name][:, i]), (j, name, i)


def _linear_row_by_row(x, w, bias=None, _linear=torch.nn.functional.linear):
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([_linear(rows[i:i + 1], w, bias) for i in range(rows.shape[0])])
    return out.view(*x.shape[:-1], w.shape[0])


def test_verify_rows_equal_plain_decode_on_the_reference_path(model_tiny, tmp_path,
                                                              monkeypatch):
    """On the reference path a verify pass is plain decode, position by position: bit for bit
    on an attention-free model (recurrent and MLP layers: the same kernels) and for one
    position with attention; with attention over several positions the keys a query reads
    are padded to the pass's longest row, which moves the last bits (as batching with a
    longer sequence does in plain decode). The reference path's linears are MKL's sgemm,
    whose rounding of a row depends on the row count on some CPUs (an AMX Xeon: 4 rows vs 16
    differ; the AVX2 and AVX-512 EPYCs did not), so they run one row at a time here: what is
    compared is the pass itself, not the BLAS."""
    from baton.model.layers.linear import reference_scope
    from baton.model.loader import load_model
    from baton.model.make_model import write_checkpoint

    monkeypatch.setattr(torch.nn.functional, "linear", _linear_row_by_row)
    recurrent = load_model(write_checkpoint(tmp_path / "m", seed=0, pattern="M-MM-M"))
    with reference_scope():
        _assert_verify_equals_decode_bit_for_bit(recurrent)
        logits, refs, *_ = _verify_vs_decode(model_tiny, 1)
        assert torch.equal(logits[:, 0], refs[0])
        logits, refs, _, a, b, _ = _verify_vs_decode(model_tiny, 4)
    for j in range(4):
        assert (logits[:, j] - refs[j]).abs().max() < 1e-5


@pytest.fixture
def fast_path():
    """The fast decode path with both kernel modules (its verify passes take the kernels)."""
    from baton.model.layers import cpu_kernels, step_kernels
    from baton.model.layers.linear import set_decode_path

    if cpu_kernels.gemv() is None or step_kernels.kernels() is None:
        pytest.skip("Baton's CPU kernels are not built on this machine")
    old = set_decode_path("fast")
    yield
    set_decode_path(old)


def test_verify_rows_equal_plain_decode_on_the_fast_path_kernels(model_tiny, tmp_path,
                                                                  fast_path):
    """On the fast path a verify pass is plain fast decode bit for bit, attention included
    (each row reads exactly its own keys through the kernel), on NemotronH and on Qwen3.5
    (gated DeltaNet, gated attention): logits and the state after every position."""
    from baton.model.loader import load_model

    _assert_verify_equals_decode_bit_for_bit(model_tiny)
    _assert_verify_equals_decode_bit_for_bit(
        load_model(agreeing_qwen_checkpoint(tmp_path)))


def test_a_speculating_engine_keeps_the_fast_path_where_the_kernels_verify(tmp_path,
                                                                          monkeypatch,
                                                                          fast_path):
    """On the fast path a speculating engine verifies on the fast path, chains and trees
    alike, and its greedy output equals a fast engine with speculation off; where the
    kernels cannot take its verify passes (here: bfloat16 pools) it runs on the reference
    path, and its output equals a reference engine with speculation off."""
    from baton.engine.speculative import decoder
    from baton.model.layers.linear import decode_path, reference_scope

    paths = []
    verify = decoder.verify_forward
    monkeypatch.setattr(decoder, "verify_forward",
                        lambda *a, **k: (paths.append(decode_path()), verify(*a, **k))[1])
    ck = agreeing_checkpoint(tmp_path)
    reqs = [(f"r{i}", prompt(60 + i, 5 + 9 * i)) for i in range(4)]

    def tokens(model=None, **spec):
        eng = engine_for(ck, worker={"max_num_seqs": 4}, speculative=spec, model=model or {})
        return run_all(eng, [Request(r, p, greedy(12)) for r, p in reqs])["tokens"]

    plain = tokens()
    for spec in ({"num_draft_tokens": 3}, {"num_draft_tokens": 3, "tree": TREE}):
        paths.clear()
        assert tokens(**spec) == plain, spec
        assert paths and set(paths) == {"fast"}, spec
    paths.clear()
    half = {"dtype": "bfloat16"}  # bfloat16 pools: no kernel verify
    got = tokens(half, num_draft_tokens=3)
    assert paths and set(paths) == {"reference"} and decode_path() == "fast"
    with reference_scope():
        assert got == tokens(half)


@pytest.fixture(scope="module")
def reference_path_off(agree_dir):
    """`reference` on the reference decode path (the default is the fast path)."""
    from baton.model.layers.linear import set_decode_path

    _trained_runs(agree_dir, "reference path")
    old = set_decode_path("reference")
    try:
        yield _reference(agree_dir)
    finally:
        set_decode_path(old)


def test_greedy_identical_to_speculation_off_on_the_reference_path(agree_dir,
                                                                   reference_path_off):
    """The 54-request workload with a tree on the reference decode path (where an engine
    speculates when the kernels cannot take its verify passes) equals the reference path
    with speculation off, every greedy token, with acceptance, prefix hits and stop tokens
    inside accepted drafts. A tree runs every part of that path's verify pass (tree_levels,
    the tree attention mask); its chains are checked bit for bit in
    `test_verify_rows_equal_plain_decode_on_the_reference_path` and test_mamba2_verify."""
    from baton.model.layers.linear import set_decode_path

    old = set_decode_path("reference")
    try:
        _assert_identical(agree_dir, reference_path_off, "tree")
    finally:
        set_decode_path(old)


def _context_head(root):
    """The agreeing head with a hidden-dependent eh_proj half: its KV entries then depend on
    the hidden state they were computed from (draft or target)."""
    from safetensors.torch import load_file, save_file

    ck = agreeing_checkpoint(root, "ctx_head")
    f = ck / "model.safetensors"
    t = load_file(str(f))
    H = t["mtp.layers.0.eh_proj.weight"].shape[0]
    g = torch.Generator().manual_seed(5)
    t["mtp.layers.0.eh_proj.weight"][:, H:] = torch.randn(H, H, generator=g) * 0.3 / H**0.5
    save_file(t, str(f), metadata={"format": "pt"})
    return ck


def _finished_draft_kv(ck, settle: bool, monkeypatch):
    from baton.engine.speculative.decoder import SpeculativeDecoder

    if not settle:
        monkeypatch.setattr(SpeculativeDecoder, "_settle", lambda *a: None)
    eng = engine_for(ck, worker={"max_num_seqs": 4}, speculative={"num_draft_tokens": 3})
    layer = eng.pools.spec.attn_index[eng.model.mtp.attention_layers[0]]
    seen = {}
    finish = eng.cache.finish

    def capture(rid, tokens):
        rows = torch.cat([eng.pools.kv[layer, b] for b in eng.cache.block_table(rid)], dim=1)
        seen[rid] = (list(tokens), rows[:, : len(tokens) - 1].clone())
        return finish(rid, tokens)

    eng.cache.finish = capture
    rng = random.Random(11)
    reqs = [Request(f"f{i}", [rng.randrange(3, 512) for _ in range(9 + i)], greedy(10 + i))
            for i in range(6)]
    run_all(eng, reqs)
    monkeypatch.undo()
    return eng, seen


def test_decode_end_snapshot_holds_verified_draft_kv(tmp_path, monkeypatch):
    """A finished request's decode-end snapshot keeps the head's KV of every position but the
    last computed from the target's hiddens (as a prefill of those tokens computes it), not
    from the last step's drafts."""
    ck = _context_head(tmp_path)
    eng, seen = _finished_draft_kv(ck, True, monkeypatch)
    _, stale = _finished_draft_kv(ck, False, monkeypatch)
    ref = engine_for(ck, worker={"max_num_seqs": 4}, speculative={"num_draft_tokens": 3})
    layer = ref.pools.spec.attn_index[ref.model.mtp.attention_layers[0]]
    differs = 0
    for rid, (tokens, got) in seen.items():
        ref.add_request(Request(rid, tokens, greedy(1), prefill_only=True))
        ref.step()
        rows = torch.cat([ref.pools.kv[layer, b] for b in ref.cache.block_table(rid)], dim=1)
        want = rows[:, : len(tokens) - 1]
        assert torch.allclose(got, want, atol=1e-4), rid
        differs += not torch.allclose(stale[rid][1], want, atol=1e-4)
        ref.release(rid)
    assert differs > 0  # without settling, draft inputs were left in the snapshot


def _next_turn_entry(ck, fix: bool, monkeypatch):
    """The head's KV at the last position of a decode-end snapshot, as the next turn (which
    hits it) leaves it after its first chunk; and the next turn's prompt."""
    from baton.engine.speculative.decoder import SpeculativeDecoder

    if not fix:
        monkeypatch.setattr(SpeculativeDecoder, "resume_entry", lambda *a: None)
    eng = engine_for(ck, worker={"max_num_seqs": 4}, speculative={"num_draft_tokens": 3})
    rng = random.Random(21)
    first = Request("t1", [rng.randrange(3, 512) for _ in range(21)], greedy(8))
    run_all(eng, [first])
    nxt = Request("t2", first.all_ids + [rng.randrange(3, 512) for _ in range(9)], greedy(2))
    eng.add_request(nxt)
    eng.step()
    c = nxt.cached_tokens
    assert c == len(first.all_ids)  # it resumed on the decode-end snapshot
    layer = eng.pools.spec.attn_index[eng.model.mtp.attention_layers[0]]
    tpb = eng.pools.spec.tokens_per_block
    block = eng.cache.block_table("t2")[(c - 1) // tpb]
    entry = eng.pools.kv[layer, block, :, (c - 1) % tpb].clone()
    monkeypatch.undo()
    return entry, nxt.prompt_ids, c


def test_next_turn_writes_the_lagging_draft_entry_of_a_decode_end_snapshot(tmp_path,
                                                                           monkeypatch):
    ck = _context_head(tmp_path)
    got, prompt_ids, c = _next_turn_entry(ck, True, monkeypatch)
    stale, _, _ = _next_turn_entry(ck, False, monkeypatch)
    ref = engine_for(ck, worker={"max_num_seqs": 4}, speculative={"num_draft_tokens": 3})
    ref.add_request(Request("r", prompt_ids, greedy(1), prefill_only=True))
    ref.step()
    layer = ref.pools.spec.attn_index[ref.model.mtp.attention_layers[0]]
    tpb = ref.pools.spec.tokens_per_block
    want = ref.pools.kv[layer, ref.cache.block_table("r")[(c - 1) // tpb], :, (c - 1) % tpb]
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(stale, want, atol=1e-2)
