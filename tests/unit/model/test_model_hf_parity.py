"""Baton's NemotronH against transformers' NemotronHForCausalLM: prefill logits and greedy text."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from baton.model.loader import load_model  # noqa: E402
from tests.support.hf_parity import (  # noqa: E402
    assert_greedy_matches,
    assert_logits_match,
    prompt_ids,
    rescale,
)

pytestmark = pytest.mark.usefixtures("model_single_thread")

# Three shapes that exercise different code paths: GQA / MQA / MHA, n_groups 1..4, several
# chunk sizes and conv kernels, and each layer kind first.
HF_CONFIGS = {
    "gqa": dict(
        hybrid_override_pattern="M*M-M*",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
    ),
    "mqa": dict(
        hybrid_override_pattern="*-M*MM-",
        hidden_size=96,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=12,
        intermediate_size=160,
        mamba_num_heads=8,
        mamba_head_dim=12,
        ssm_state_size=8,
        n_groups=4,
        conv_kernel=3,
        chunk_size=32,
    ),
    "mha": dict(
        hybrid_override_pattern="-MM*M",
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=6,
        head_dim=8,
        intermediate_size=96,
        mamba_num_heads=6,
        mamba_head_dim=16,
        ssm_state_size=12,
        n_groups=1,
        chunk_size=64,
    ),
}
PROMPT_LENGTHS = [1, 2, 15, 16, 33, 100, 257, 600]
NEW_TOKENS = 32
TPB = 16


@pytest.fixture(scope="session", params=sorted(HF_CONFIGS))
def model_hf_pair(request, tmp_path_factory):
    """(HF model, Baton model loaded from HF's save_pretrained output) for one config."""
    fields = HF_CONFIGS[request.param]
    cfg = transformers.NemotronHConfig(vocab_size=300, **fields)
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(cfg).eval()
    rescale(hf, seed=len(request.param))
    out = tmp_path_factory.mktemp(f"hf_{request.param}")
    hf.save_pretrained(out)
    return hf, load_model(out)


def test_prefill_logits_match_hf_at_every_position(model_hf_pair):
    hf, model = model_hf_pair
    assert_logits_match(hf, model, prompt_ids(600, seed=1), TPB)


def test_greedy_matches_hf_generate_with_batched_decode(model_hf_pair):
    hf, model = model_hf_pair
    assert_greedy_matches(hf, model, PROMPT_LENGTHS, NEW_TOKENS, TPB)


def test_generated_checkpoint_loads_in_hf_unchanged(model_tiny_dir, model_tiny):
    hf = transformers.NemotronHForCausalLM.from_pretrained(model_tiny_dir).eval()
    ours, _ = assert_logits_match(hf, model_tiny, prompt_ids(70, seed=7), TPB)
    assert len(set(ours.argmax(-1).tolist())) > 10
