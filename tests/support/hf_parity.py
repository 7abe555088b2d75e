"""Shared checks of a Baton model against its transformers counterpart (every family's parity
tests use them): seeded prompts, fan-in rescaling of HF's init, logits at every position,
batched prefill, and greedy tokens with batched decode against `hf.generate`.

Every check asserts; each returns what it computed so a test can assert more on it.
"""

from __future__ import annotations

import math

import torch

VOCAB = 300
"""The parity configs' vocabulary (prompt ids are drawn from 3..VOCAB-1)."""
MAX_ERR = 1e-4
"""fp32 logits agree this closely at every position."""


def prompt_ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def rescale(model, seed: int, dims: tuple[int, ...] = (2,)) -> None:
    """Fan-in scaled weights of `dims` dimensions (MoE models: (2, 3), fused experts and conv
    kernels too): HF's 0.02-std init gives near-tied logits (and idle experts), so greedy would
    not be meaningful. Output projections shrink with depth; routing-bias buffers
    (`e_score_correction_bias`) get a spread large enough to change the chosen experts."""
    gen = torch.Generator().manual_seed(seed)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embeddings.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / math.sqrt(p.shape[1]))
            elif p.dim() in dims:
                std = 1 / math.sqrt(p.shape[-1])
                if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight",
                                  "experts.down_proj")):
                    std /= math.sqrt(layers)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of HF on a batch [B, T] (or one prompt [T]: [T, vocab])."""
    with torch.no_grad():
        out = hf(ids if ids.dim() == 2 else ids[None]).logits.float()
    return out if ids.dim() == 2 else out[0]


def assert_logits_match(hf, model, ids: torch.Tensor, tpb: int,
                        max_err: float = MAX_ERR) -> tuple[torch.Tensor, torch.Tensor]:
    """One prompt prefilled from position 0: logits at every position within `max_err` of
    HF's. Returns (Baton's, HF's) logits [T, vocab]."""
    n_blocks = -(-len(ids) // tpb)
    pools = model.make_pools(num_blocks=n_blocks, tokens_per_block=tpb, num_slots=1)
    ours = model.prefill(ids, 0, list(range(n_blocks)), 0, pools, all_logits=True)
    ref = hf_logits(hf, ids)
    assert ours.shape == ref.shape == (len(ids), ref.shape[-1])
    err = (ours - ref).abs().max().item()
    assert err < max_err, f"length {len(ids)}: max |logit difference| {err:.3g}"
    return ours, ref


def assert_batched_prefill_matches(hf, model, ids: torch.Tensor, tpb: int) -> torch.Tensor:
    """A batch [B, T] prefilled as one call, block tables interleaved: logits within MAX_ERR
    of HF's batch."""
    b = ids.shape[0]
    n_blocks = b * -(-ids.shape[1] // tpb)
    pools = model.make_pools(num_blocks=n_blocks, tokens_per_block=tpb, num_slots=b)
    tables = [list(range(i, n_blocks, b)) for i in range(b)]
    ours = model.prefill_batch(ids, [0] * b, tables, list(range(b)), pools, all_logits=True)
    err = (ours - hf_logits(hf, ids)).abs().max().item()
    assert err < MAX_ERR, f"batch of {b}: max |logit difference| {err:.3g}"
    return ours


def baton_greedy(model, prompts: list[torch.Tensor], tables: list[list[int]],
                 slots: list[int], pools, new_tokens: int) -> list[list[int]]:
    """Prefill each prompt into its own slot, then decode all of them as one batch."""
    out = [[int(model.prefill(p, 0, tables[i], slots[i], pools).argmax())]
           for i, p in enumerate(prompts)]
    positions = torch.tensor([len(p) for p in prompts])
    slot_ids = torch.tensor(slots)
    for _ in range(new_tokens - 1):
        last = torch.tensor([seq[-1] for seq in out])
        nxt = model.decode(last, positions, tables, slot_ids, pools).argmax(-1)
        for seq, t in zip(out, nxt.tolist(), strict=True):
            seq.append(t)
        positions = positions + 1
    return out


def assert_greedy_matches(hf, model, lengths: list[int], new_tokens: int, tpb: int,
                          reverse_slots: bool = False) -> list[list[int]]:
    """Greedy tokens of prompts of `lengths` (seeds 100 + length), prefilled one by one and
    decoded as one batch over interleaved block tables (slots in reverse order if asked),
    equal `hf.generate`'s; the output is not degenerate."""
    prompts = [prompt_ids(n, seed=100 + n) for n in lengths]
    per_seq = -(-(max(lengths) + new_tokens) // tpb)
    pools = model.make_pools(len(prompts) * per_seq, tpb, len(prompts))
    # interleaved block tables: no sequence owns a contiguous pool range
    tables = [list(range(i, len(prompts) * per_seq, len(prompts))) for i in range(len(prompts))]
    slots = list(range(len(prompts)))
    ours = baton_greedy(model, prompts, tables, slots[::-1] if reverse_slots else slots, pools,
                        new_tokens)
    hf.generation_config.eos_token_id = None
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(prompt[None], max_new_tokens=new_tokens, do_sample=False)
        assert got == ref[0, len(prompt):].tolist(), f"prompt length {len(prompt)}"
    assert len({t for seq in ours for t in seq}) > 8, "greedy output is degenerate"
    return ours
