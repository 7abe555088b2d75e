"""The opt-in integer path of packed int8 / int4 weights (`model.quantize_activations: int8`,
`cpu_kernels/gemv_int.h`): activations quantized to int8 per 32 columns, integer dot
products, one fixed float order. On every instruction set each output equals the torch
reference of the same math (`packed.int_linear_reference`) bit for bit, for odd shapes; a row
alone equals the row in any batch at 1 and 2 threads; the path is chosen per weight (its
mark), so unmarked weights keep the exact path in the same call and process; an engine with
it gives each request's greedy tokens whatever the batch, and a prompt's logits close to the
exact path's."""

from __future__ import annotations

import pytest
import torch

from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.errors import ConfigError
from baton.model.layers.linear import FastLinear, decode_scope
from baton.model.make_model import write_checkpoint
from baton.model.quant import packed
from tests.support.engine_helpers import engine_for, run_alone, run_staggered, staggered
from tests.support.hf_parity import prompt_ids

ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
SHAPES = {"int8": [(1, 1, 1), (1, 13, 15), (3, 37, 17), (16, 100, 77), (7, 41, 768),
                   (13, 75, 203), (2, 64, 32), (1, 21, 1040), (5, 9, 64)],
          "int4": [(1, 1, 32), (1, 13, 64), (3, 37, 96), (16, 100, 224), (7, 41, 768),
                   (13, 75, 1056), (2, 9, 32),
                   (1, 45, 160), (1, 61, 1024)]}  # one row: blocks of 16, then 8, then 1
SHAPES["int8g"] = SHAPES["int8"] + [(3, 11, 33), (2, 7, 95)]  # partial last groups
CASES = [(mode, *s) for mode, shapes in SHAPES.items() for s in shapes]


@pytest.fixture(scope="module")
def kernel():
    from baton.model.layers import cpu_kernels

    k = cpu_kernels.gemv()
    if k is None:
        pytest.skip("Baton's CPU kernels are not built here")
    return k


def _marked(w: torch.Tensor, mode: str) -> torch.Tensor:
    p = packed.pack(w, mode)
    packed.mark_int_path(p)
    return p


def _data(m, n, k, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, n, k, generator=g) * 0.1
    x = torch.randn(m, k, generator=g)
    x[:, ::7] *= 9  # outliers: groups with other scales
    return x, w, torch.randn(n, generator=g)


@pytest.mark.parametrize("mode,m,n,k", CASES)
def test_every_instruction_set_equals_the_torch_reference(kernel, mode, m, n, k):
    x, w, b = _data(m, n, k, seed=n * k + m)
    p = _marked(w, mode)
    assert packed.int_path(p)
    want = packed.int_linear_reference(x, p, b)
    for isa in ISAS.values():
        assert torch.equal(kernel.linear(x, p, b, isa), want), isa
        assert torch.equal(kernel.linear(x, p, None, isa),
                           packed.int_linear_reference(x, p)), isa
    exact = x.double() @ packed.dense(p).double().T + b.double()
    assert ((want - exact).norm() / exact.norm()).item() < 0.02  # int8 activations' error


@pytest.mark.parametrize("mode", ["int8", "int8g", "int4"])
def test_a_row_alone_equals_the_row_in_any_batch_at_1_and_2_threads(kernel, mode):
    x, w, b = _data(40, 600, 224, seed=3)
    p = _marked(w, mode)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([kernel.linear(x[i:i + 1], p, b) for i in range(40)])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 5, 8, 13, 33, 40):
                assert torch.equal(kernel.linear(x[:m], p, b), alone[:m]), (m, threads)
            assert torch.equal(kernel.linear(x[5:17], p, b), alone[5:17]), threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("mode", ["int8", "int8g", "int4"])
def test_a_prefill_quantized_over_2_threads_equals_1(kernel, mode):
    # 600 rows of 288 columns: x's rows quantized in several tasks at 2 threads (gemv_int.h
    # quantize_rows), every instruction set; the rows' own bits whatever the split.
    x, w, b = _data(600, 24, 288, seed=13)
    p = _marked(w, mode)
    want = packed.int_linear_reference(x, p, b)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for isa in ISAS.values():
                assert torch.equal(kernel.linear(x, p, b, isa), want), (threads, isa)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("mode", ["int8", "int8g", "int4"])
def test_nan_and_inf_activations_quantize_alike_on_every_instruction_set(kernel, mode):
    # x quantized in AVX-512 or plain C++ (gemv_int.h quantize_row512 / quantize_row): a NaN
    # skipped by the group's max and clamped to 127, an infinity's group d = inf.
    x, w, _ = _data(6, 24, 96, seed=17)
    x[1, 5], x[2, 40], x[3, 70] = float("nan"), float("inf"), -float("inf")
    x[4, 3:9] = float("nan")
    p = _marked(w, mode)
    got = [kernel.linear(x, p, None, isa) for isa in ISAS.values()]
    for g in got[1:]:
        assert torch.equal(g.isnan(), got[0].isnan())
        assert torch.equal(g.nan_to_num(0.0), got[0].nan_to_num(0.0))
    assert got[0][[0, 1, 4, 5]].isfinite().all()  # a NaN quantizes to 127, a finite value


@pytest.mark.parametrize("isa", sorted(ISAS))
def test_the_path_is_per_weight(kernel, isa):
    # linear_cat / linear_split of a marked int8, a float and an unmarked int4 weight: each
    # part as its own path computes it; unmarking restores the exact path.
    x, w, _ = _data(5, 70, 96, seed=5)
    parts = [_marked(w[:30], "int8"), w[30:50].contiguous(), packed.pack(w[50:], "int4")]
    want = [packed.int_linear_reference(x, parts[0]),
            kernel.linear(x, parts[1], None, ISAS[isa]),
            kernel.linear(x, packed.dense(parts[2]), None, ISAS[isa])]
    assert torch.equal(kernel.linear_cat(x, parts, ISAS[isa]), torch.cat(want, dim=1))
    split = kernel.linear_split(x, parts, ISAS[isa])
    assert all(torch.equal(a, c) for a, c in zip(split, want, strict=True))
    packed.mark_int_path(parts[0], False)
    assert not packed.int_path(parts[0])
    assert torch.equal(kernel.linear(x, parts[0], None, ISAS[isa]),
                       kernel.linear(x, packed.dense(parts[0]), None, ISAS[isa]))


@pytest.mark.parametrize("mode", ["int8", "int8g", "int4"])
@pytest.mark.parametrize("isa", sorted(ISAS))
def test_grouped_linear_over_marked_expert_stacks(kernel, mode, isa):
    x, w, _ = _data(9, 40, 64, seed=7, lead=(5,))
    p = _marked(w, mode)
    counts = torch.tensor([2, 0, 4, 1, 2])
    got = kernel.grouped_linear(x, p, counts, None, ISAS[isa])
    at, want = 0, []
    for e, c in enumerate(counts.tolist()):
        want.append(packed.int_linear_reference(x[at:at + c], p[e]))
        at += c
    assert torch.equal(got, torch.cat(want))
    rows = torch.tensor([8, 0, 3, 3, 1, 7, 2, 5, 4])  # the MoE blocks' gathered rows
    assert torch.equal(kernel.grouped_linear(x, p, counts, rows, ISAS[isa]),
                       kernel.grouped_linear(x[rows], p, counts, None, ISAS[isa]))


@pytest.mark.parametrize("mode", ["int8", "int8g", "int4"])
def test_fast_linear_prefill_takes_the_integer_path(kernel, mode):
    x, w, b = _data(300, 600, 128, seed=11)
    lin = FastLinear(128, 600)
    with torch.no_grad():
        lin.weight = torch.nn.Parameter(_marked(w, mode), requires_grad=False)
        lin.bias.copy_(b)
        want = packed.int_linear_reference(x, lin.weight, b)
        assert torch.equal(lin(x), want)  # a prefill: every row on the integer path
        with decode_scope():
            assert torch.equal(lin(x[:7]), want[:7])


# ---- an engine with model.quantize_activations ----------------------------------------------

MODEL = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, pattern="M*M-", mamba_num_heads=8,
             mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=32)
CONFIG = dict(cache={"num_blocks": 256, "num_state_slots": 32, "enable_prefix_reuse": False},
              worker={"max_num_seqs": 8, "prefill_chunk_size": 16})


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("int_path") / "f", seed=4, **MODEL)


@pytest.mark.usefixtures("model_single_thread")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_engine_tokens_do_not_depend_on_the_batch(kernel, src, mode):
    # model.quantize int8 on the integer path packs per 32 columns (int8g, Q8_0's blocks)
    eng = engine_for(src, model={"quantize": mode, "quantize_activations": "int8"}, **CONFIG)
    held = [p for p in eng.model.parameters() if packed.kind(p) is not None]
    assert held and {packed.kind(p) for p in held} == {"int8g" if mode == "int8" else mode}
    assert all(packed.int_path(p) for p in held)
    assert eng.weights.format == ("w8a16_g32" if mode == "int8" else "w4a16_g32") \
        + "+int8_activations"
    work = staggered(6)
    batched = run_staggered(eng, work)
    for _, r in work:
        alone = run_alone(eng, r.id + "-alone", r.prompt_ids, r.sampling.max_tokens)[0]
        assert alone == batched[r.id], r.id
    # a prompt's logits: close to the exact path's (KL from it, per token)
    m = eng.model
    exact = engine_for(src, model={"quantize": mode}, **CONFIG).model
    assert not any(packed.int_path(p) for p in exact.parameters())
    ids = prompt_ids(50, seed=3)

    def logits(model, cuts):
        pools = model.make_pools(num_blocks=8, tokens_per_block=16, num_slots=1)
        out, at = [], 0
        for cut in [*cuts, len(ids)]:
            out.append(model.prefill(ids[at:cut], at, list(range(8)), 0, pools,
                                     all_logits=True))
            at = cut
        return torch.cat(out)

    whole = logits(m, [])
    assert torch.equal(logits(m, []), whole)
    ref = torch.log_softmax(logits(exact, []), -1)
    kl = (ref.exp() * (ref - torch.log_softmax(whole, -1))).sum(-1).mean().item()
    assert 0 < kl < 1e-3, kl


@pytest.mark.usefixtures("model_single_thread")
@pytest.mark.parametrize("family", ["nemotron_h_moe", "qwen3_5_moe"])
def test_moe_engine_tokens_do_not_depend_on_the_batch(kernel, tmp_path, family):
    # routed and shared experts on the integer path (grouped_linear, the one-call MoE blocks)
    common = {k: v for k, v in MODEL.items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim")}
    extra = (dict(pattern="M*ME", mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                  n_groups=2, chunk_size=32, moe_intermediate_size=96,
                  moe_shared_expert_intermediate_size=128) if family == "nemotron_h_moe" else
             dict(family="qwen3_5_moe", pattern="G*G", linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                  shared_expert_intermediate_size=128))
    src = write_checkpoint(tmp_path / family, seed=4, **common, **extra)
    eng = engine_for(src, model={"quantize": "int8", "quantize_activations": "int8"}, **CONFIG)
    experts = [p for n, p in eng.model.named_parameters() if "experts" in n
               and packed.kind(p) == "int8g"]
    assert experts and all(packed.int_path(p) for p in experts)
    work = staggered(5)
    batched = run_staggered(eng, work)
    for _, r in work:
        alone = run_alone(eng, r.id + "-alone", r.prompt_ids, r.sampling.max_tokens)[0]
        assert alone == batched[r.id], r.id


def test_quantize_activations_without_int_weights_is_refused(src):
    cfg = BatonConfig.from_dict({"model": {"quantize_activations": "int8"}, **CONFIG})
    with pytest.raises(ConfigError, match="model.quantize_activations='int8': no int8 / int4 "
                                          "weights are held"):
        build_engine(cfg, str(src))


@pytest.mark.usefixtures("model_single_thread")
@pytest.mark.parametrize("tie", [False, True])
def test_quantized_embeddings_and_lm_head(tmp_path, tie):
    # model.quantize_embeddings: the table and the head packed int8 per 32 columns (int8g;
    # tied: one tensor); a lookup decodes just its rows, as `packed.dense` decodes them.
    src = write_checkpoint(tmp_path / "m", seed=4, tie_word_embeddings=tie, **MODEL)
    plain = engine_for(src, model={"quantize": "int8"}, **CONFIG)
    eng = engine_for(src, model={"quantize": "int8", "quantize_embeddings": "int8"}, **CONFIG)
    table, head = eng.model.embedding, eng.model.lm_head.weight
    assert isinstance(table, packed.PackedEmbedding) and packed.kind(head) == "int8g"
    assert (head is table.weight) == tie
    assert eng.weights.format == "w8a16_channel+int8_g32_embeddings"
    ids = torch.tensor([[3, 299, 0], [7, 7, 150]])
    assert torch.equal(table(ids), packed.dense(table.weight)[ids])
    float_table = plain.model.embedding.weight
    assert torch.allclose(table(ids), float_table[ids], atol=float_table.abs().max() / 127)
    assert eng.weights.bytes < plain.weights.bytes - 0.7 * float_table.numel() * 4 * (2 - tie)
    # this seeded model's greedy tokens stay those of the float table and head
    assert run_staggered(eng, staggered(4)) == run_staggered(plain, staggered(4))
    cfg = BatonConfig.from_dict({"model": {"quantize_embeddings": "int8"},
                                 "worker": {"tensor_parallel_size": 2}})
    with pytest.raises(ConfigError, match="model.quantize_embeddings='int8' runs in single"):
        build_engine(cfg, str(src))


def test_quantize_activations_flag_on_serve_and_workers():
    from baton.cli import build_parser
    from baton.cluster.local import _worker_flags
    from baton.contract import Role
    from baton.worker.host import _worker_config

    parser = build_parser()
    serve = parser.parse_args(["serve", "--quantize", "int4", "--quantize-activations", "int8"])
    assert _worker_flags(serve) == ("--quantize", "int4", "--quantize-activations", "int8")
    args = parser.parse_args(["decode-worker", "--router", "h:1", "--quantize-activations",
                              "int8"])
    assert _worker_config(args, Role.DECODE).model.quantize_activations == "int8"
    args = parser.parse_args(["generate", "--local", "--quantize-activations", "int8",
                              "--prompt", "hi"])
    assert args.quantize_activations == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantize-activations", "int4"])
