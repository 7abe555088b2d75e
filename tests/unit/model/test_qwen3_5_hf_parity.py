"""Baton's Qwen3.5 against transformers' Qwen3_5ForCausalLM on seeded checkpoints Baton writes:
prefill logits at every position, greedy tokens with batched decode, prompt lengths around the
64-token DeltaNet chunk, batched and resumed prefill equal to one-shot."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from baton.model.loader import load_model  # noqa: E402
from baton.model.qwen3_5.make import write_checkpoint  # noqa: E402
from tests.support.hf_parity import assert_greedy_matches, assert_logits_match, prompt_ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("model_single_thread")

# key heads != value heads in both (r = 2 and r = 3), conv kernels 4 and 3, untied and tied,
# an explicit `layer_types` and a `full_attention_interval`, the text and multimodal layouts.
QWEN_CONFIGS = {
    "text_k4": dict(
        pattern="GG*G*G", vocab_size=300, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4,
    ),
    "multimodal_k3_tied": dict(
        multimodal=True, num_hidden_layers=6, full_attention_interval=3, vocab_size=300,
        hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3,
        head_dim=8, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=3, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    ),
}
GREEDY_LENGTHS = [1, 2, 63, 64, 65, 127, 128, 129, 200, 1000]
LOGIT_LENGTHS = [1, 63, 64, 65, 128, 129, 3001]
NEW_TOKENS = 16
TPB = 16
MAX_ERR = 1e-4


@pytest.fixture(scope="session", params=sorted(QWEN_CONFIGS))
def qwen_pair(request, tmp_path_factory):
    """(HF model, Baton model) of one config, both loaded from the checkpoint Baton wrote."""
    fields = dict(QWEN_CONFIGS[request.param])
    out = write_checkpoint(tmp_path_factory.mktemp(f"qwen_{request.param}"), seed=3, **fields)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    hf.generation_config.eos_token_id = None
    return hf, load_model(out)


def _blocks(n_tokens: int) -> list[int]:
    return list(range(-(-n_tokens // TPB)))


def test_prefill_logits_match_hf_at_every_position(qwen_pair):
    hf, model = qwen_pair
    for T in LOGIT_LENGTHS:
        ours, ref = assert_logits_match(hf, model, prompt_ids(T, seed=T), TPB, MAX_ERR)
        assert (ours.argmax(-1) == ref.argmax(-1)).all(), f"length {T}"


def test_greedy_matches_hf_generate_with_batched_decode(qwen_pair):
    hf, model = qwen_pair
    # interleaved block tables, and slots in reverse order (not one consecutive range)
    assert_greedy_matches(hf, model, GREEDY_LENGTHS, NEW_TOKENS, TPB, reverse_slots=True)


def test_batched_prefill_equals_each_alone(qwen_pair):
    _, model = qwen_pair
    for T in (1, 64, 65):
        ids = torch.stack([prompt_ids(T, seed=500 + i) for i in range(3)])
        n = len(_blocks(T))
        pools = model.make_pools(3 * n, TPB, 3)
        tables = [[i * n + j for j in range(n)] for i in range(3)]
        both = model.prefill_batch(ids, [0, 0, 0], tables, [0, 1, 2], pools, all_logits=True)
        for i in range(3):
            alone_pools = model.make_pools(n, TPB, 1)
            alone = model.prefill(ids[i], 0, _blocks(T), 0, alone_pools, all_logits=True)
            assert (both[i] - alone).abs().max().item() < 1e-5, (T, i)
            for name, t in _state(alone_pools, 0).items():
                assert torch.allclose(_state(pools, i)[name], t, atol=1e-5), (T, i, name)


SPLITS = [(1,), (63,), (64,), (65,), (30, 64), (64, 128), (1, 2, 3, 100), (127, 129)]


@pytest.mark.parametrize("cuts", SPLITS, ids=lambda c: "-".join(map(str, c)))
def test_resumed_prefill_equals_one_shot(qwen_pair, cuts):
    """A prompt prefilled in several calls, each resuming from the saved state, gives the
    one-shot logits at every position and the same state and KV (to float32 rounding: the
    chunks start at each call's first token)."""
    _, model = qwen_pair
    T = 150
    ids = prompt_ids(T, seed=9)
    one_pools = model.make_pools(len(_blocks(T)), TPB, 1)
    one = model.prefill(ids, 0, _blocks(T), 0, one_pools, all_logits=True)
    pools = model.make_pools(len(_blocks(T)), TPB, 2)
    bounds = [0, *cuts, T]
    parts = [model.prefill(ids[a:b], a, _blocks(T), 1, pools, all_logits=True)
             for a, b in zip(bounds, bounds[1:], strict=False)]
    got = torch.cat(parts)
    assert (got - one).abs().max().item() < MAX_ERR
    assert (got.argmax(-1) == one.argmax(-1)).all()
    for name, t in _state(one_pools, 0).items():
        assert torch.allclose(_state(pools, 1)[name], t, atol=MAX_ERR), name
    if pools.has_kv:
        assert torch.allclose(pools.kv, one_pools.kv, atol=MAX_ERR)


def _state(pools, slot: int) -> dict[str, torch.Tensor]:
    """The slot's state tensors, every DeltaNet layer."""
    return {k: v[:, slot] for k, v in pools.state.items()}
