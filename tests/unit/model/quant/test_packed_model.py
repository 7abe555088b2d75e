"""`model.quantize: int8 | int4` keeps the weights packed (`baton/model/quant/packed.py`) and
serves them through the CPU kernels as stored (the written checkpoint loads packed too).
Against the `baton quantize`-written checkpoint decoded into float32 at load
(`BATON_PACKED_WEIGHTS=0`: the reference), for each family dense and
MoE: every packed weight decodes to the reference's bits, the engine's greedy tokens are the
reference's under a staggered workload (one-row and many-row decode steps, chunked prefills,
MoE experts), a prompt's logits are the reference's whatever its chunking, and int8 keeps
float32's top token where float32 leads clearly."""

from __future__ import annotations

import pytest
import torch

from baton.model.loader import load_model
from baton.model.make_model import write_checkpoint
from baton.model.quant import packed
from baton.model.quant.quantize import write_quantized
from tests.support.engine_helpers import engine_for, run_staggered, staggered
from tests.support.hf_parity import prompt_ids

pytestmark = pytest.mark.usefixtures("model_single_thread")

COMMON = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32)
MODELS = {
    "nemotron_h": dict(pattern="M*M-", mamba_num_heads=8, mamba_head_dim=16,
                       ssm_state_size=16, n_groups=2, chunk_size=32, **COMMON),
    "nemotron_h_moe": dict(pattern="M*ME", mamba_num_heads=8, mamba_head_dim=16,
                           ssm_state_size=16, n_groups=2, chunk_size=32,
                           moe_intermediate_size=96, moe_shared_expert_intermediate_size=128,
                           **COMMON),
    "qwen3_5": dict(family="qwen3_5", pattern="GG*G", linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    **COMMON),
    "qwen3_5_moe": dict(family="qwen3_5_moe", pattern="G*G", linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=96, shared_expert_intermediate_size=128, **COMMON),
}
CONFIG = dict(cache={"num_blocks": 256, "num_state_slots": 32, "enable_prefix_reuse": False},
              worker={"max_num_seqs": 8, "prefill_chunk_size": 16})


@pytest.fixture(scope="module", params=sorted(MODELS))
def src(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param) / "f", seed=4,
                            **MODELS[request.param])


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_packed_model_serves_the_written_checkpoints_tokens(src, mode, tmp_path, monkeypatch):
    written = write_quantized(src, tmp_path / mode, mode)
    got = load_model(src, quantize=mode)
    assert {packed.kind(p) for p in load_model(written).parameters()} - {None} == {mode}
    monkeypatch.setenv("BATON_PACKED_WEIGHTS", "0")  # the reference: decoded into float32
    ref = load_model(written)
    params = dict(got.named_parameters())
    kinds = {n: packed.kind(p) for n, p in params.items() if packed.kind(p) is not None}
    assert len(kinds) > 5 and set(kinds.values()) == {mode}
    for name, p in ref.named_parameters():
        assert torch.equal(packed.dense(params[name]), p), name
    if "moe" in str(src.parent):
        assert any("experts" in n for n in kinds)
    # a prompt's logits: whole, and in chunks (prefill tiles do not depend on the rows)
    ids = prompt_ids(50, seed=3)

    def logits(m, cuts):
        pools = m.make_pools(num_blocks=8, tokens_per_block=16, num_slots=1)
        out, at = [], 0
        for cut in [*cuts, len(ids)]:
            out.append(m.prefill(ids[at:cut], at, list(range(8)), 0, pools, all_logits=True))
            at = cut
        return torch.cat(out)

    whole = logits(got, [])
    assert torch.equal(whole, logits(ref, []))
    assert torch.equal(logits(got, [16, 32]), logits(ref, [16, 32]))
    ours = run_staggered(engine_for(src, model={"quantize": mode}, **CONFIG), staggered(8))
    assert ours == run_staggered(engine_for(written, **CONFIG), staggered(8))
    assert min(map(len, ours.values())) >= 8


def test_int8_keeps_float32s_clear_top_token(src):
    if "moe" in str(src.parent):  # a small change can flip a tiny random router's choice
        pytest.skip("dense models")
    ids = prompt_ids(200, seed=9)

    def logits(m):
        pools = m.make_pools(num_blocks=13, tokens_per_block=16, num_slots=1)
        return m.prefill(ids, 0, list(range(13)), 0, pools, all_logits=True)

    f, g = logits(load_model(src)), logits(load_model(src, quantize="int8"))
    top2 = f.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    assert clear.sum() > 100
    assert torch.equal(f.argmax(-1)[clear], g.argmax(-1)[clear])


STORED = {"qwen_fp8": {"fp8"}, "modelopt_fp8": {"fp8"}, "ct_fp8": {"fp8"},
          "modelopt_nvfp4": {"nvfp4"}, "modelopt_mixed": {"fp8", "nvfp4"}}


@pytest.mark.parametrize("layout", sorted(STORED))
def test_quantized_checkpoints_stay_packed_as_stored(src, layout, tmp_path, monkeypatch):
    # A published layout's fp8 (128 x 128 tiles, per tensor, per channel) and NVFP4 weights
    # (MoE experts one tensor each, stacked packed) are kept as stored and served through the
    # kernels (int4 stored in groups of 32 with float16 scales:
    # the written checkpoints above; this layout's groups of 16 are decoded): each decodes to the
    # float32 the loader decodes it to (BATON_PACKED_WEIGHTS=0), the logits and greedy tokens
    # are that model's, bit for bit.
    from bench import quant_layouts

    q = quant_layouts.write(src, tmp_path / layout, layout, scale_dtype=torch.float16)
    got = load_model(q)
    kinds = {n: packed.kind(p) for n, p in got.named_parameters() if packed.kind(p)}
    moe = "moe" in str(src.parent)
    # Nemotron 3 Super's mix: only the routed experts are NVFP4
    assert set(kinds.values()) == (STORED[layout] if moe or layout != "modelopt_mixed"
                                   else {"fp8"})
    if moe:  # the per-expert tensors stacked packed
        assert any(n.endswith(("experts.up_proj", "experts.gate_up_proj")) for n in kinds)
    monkeypatch.setenv("BATON_PACKED_WEIGHTS", "0")
    ref = load_model(q)
    params = dict(got.named_parameters())
    for name, p in ref.named_parameters():
        assert torch.equal(packed.dense(params[name]), p), name
    ids = prompt_ids(40, seed=5)
    pools = [m.make_pools(num_blocks=8, tokens_per_block=16, num_slots=1) for m in (got, ref)]
    assert torch.equal(got.prefill(ids, 0, list(range(8)), 0, pools[0], all_logits=True),
                       ref.prefill(ids, 0, list(range(8)), 0, pools[1], all_logits=True))
    want = run_staggered(engine_for(q, **CONFIG), staggered(6))
    monkeypatch.delenv("BATON_PACKED_WEIGHTS")
    assert run_staggered(engine_for(q, **CONFIG), staggered(6)) == want
