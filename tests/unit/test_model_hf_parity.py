"""Baton's NemotronH against transformers' NemotronHForCausalLM: prefill logits and greedy text."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from baton.model.loader import load_model  # noqa: E402

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


def _rescale(model, seed: int) -> None:
    """HF's 0.02-std init gives near-tied logits; use fan-in scales so greedy is meaningful."""
    gen = torch.Generator().manual_seed(seed)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embeddings.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / math.sqrt(p.shape[1]))
            elif p.dim() == 2:
                std = 1 / math.sqrt(p.shape[1])
                if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                    std /= math.sqrt(layers)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="session", params=sorted(HF_CONFIGS))
def model_hf_pair(request, tmp_path_factory):
    """(HF model, Baton model loaded from HF's save_pretrained output) for one config."""
    fields = HF_CONFIGS[request.param]
    cfg = transformers.NemotronHConfig(vocab_size=300, **fields)
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(cfg).eval()
    _rescale(hf, seed=len(request.param))
    out = tmp_path_factory.mktemp(f"hf_{request.param}")
    hf.save_pretrained(out)
    return hf, load_model(out)


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_hf_at_every_position(model_hf_pair):
    hf, model = model_hf_pair
    ids = _prompt(600, seed=1)
    pools = model.make_pools(num_blocks=40, tokens_per_block=TPB, num_slots=1)
    ours = model.prefill(ids, 0, list(range(40)), 0, pools, all_logits=True)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    assert ours.shape == ref.shape == (600, 300)
    assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_matches_hf_generate_with_batched_decode(model_hf_pair):
    hf, model = model_hf_pair
    prompts = [_prompt(n, seed=100 + n) for n in PROMPT_LENGTHS]
    per_seq = -(-(max(PROMPT_LENGTHS) + NEW_TOKENS) // TPB)
    pools = model.make_pools(len(prompts) * per_seq, TPB, len(prompts))
    # Interleave the block tables so sequences never own contiguous pool ranges.
    tables = [list(range(i, len(prompts) * per_seq, len(prompts))) for i in range(len(prompts))]
    ours = _baton_greedy(model, prompts, tables, pools)
    hf.generation_config.eos_token_id = None
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True
            )
        assert got == ref[0, len(prompt) :].tolist(), f"prompt length {len(prompt)}"
    assert len({t for seq in ours for t in seq}) > 8, "greedy output is degenerate"


def _baton_greedy(model, prompts, tables, pools) -> list[list[int]]:
    """Prefill each prompt into its own slot, then decode all of them as one batch."""
    first = [int(model.prefill(p, 0, tables[i], i, pools).argmax()) for i, p in enumerate(prompts)]
    out = [[t] for t in first]
    positions = torch.tensor([len(p) for p in prompts])
    slots = torch.arange(len(prompts))
    for _ in range(NEW_TOKENS - 1):
        last = torch.tensor([seq[-1] for seq in out])
        nxt = model.decode(last, positions, tables, slots, pools).argmax(-1)
        for seq, t in zip(out, nxt.tolist(), strict=True):
            seq.append(t)
        positions = positions + 1
    return out


def test_generated_checkpoint_loads_in_hf_unchanged(model_tiny_dir, model_tiny):
    hf = transformers.NemotronHForCausalLM.from_pretrained(model_tiny_dir).eval()
    ids = _prompt(70, seed=7)
    pools = model_tiny.make_pools(num_blocks=8, tokens_per_block=TPB, num_slots=1)
    ours = model_tiny.prefill(ids, 0, list(range(8)), 0, pools, all_logits=True)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4
    assert len(set(ours.argmax(-1).tolist())) > 10
