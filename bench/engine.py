"""`baton bench engine`: output tokens/s at 1, 8, 32 concurrent requests vs HF `generate`, per
model family (NemotronH, Qwen3.5), with the recurrent state bytes one request holds; then the
MoE rows (`bench/moe.py`: forward vs transformers', MoE next to dense, load RSS). With
`--peer llamacpp`: side by side with llama.cpp on the same checkpoint (bench/engine_peer.py)."""

from __future__ import annotations

import sys
import time

import torch

from bench.common import checkpoint, decode_engine, prompts


def _baton(path, reqs, out_len: int) -> float:
    from baton.engine.request import Request, SamplingParams

    n = len(reqs)
    total = len(reqs[0]) + out_len
    eng = decode_engine(path, n, total)
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(reqs):
        eng.add_request(Request(f"b{i}", p, sp))
    produced = 0
    while eng.has_work:
        produced += sum(len(o.new_token_ids) for o in eng.step())
    dt = time.perf_counter() - t0
    assert produced == n * out_len, (produced, n * out_len)
    return produced / dt


def _hf(path, reqs, out_len: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor(reqs, dtype=torch.long)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
            min_new_tokens=out_len, do_sample=False, pad_token_id=0,
        )
    dt = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


def run(args) -> list[dict]:
    if getattr(args, "peer", None) == "llamacpp":
        from bench.engine_peer import run as run_peer

        return run_peer(args)
    quick = getattr(args, "quick", False)
    prompt_len, out_len = (128, 32) if quick else (512, 128)
    presets = ("tiny",) if quick else ("tiny", "100m")
    rows = []
    for family, preset in [(f, p) for p in presets for f in ("nemotron_h", "qwen3_5")]:
        path = checkpoint(preset, family)
        vocab = _vocab(path)
        state_bytes = _state_bytes(path)
        print(f"[bench engine] {family} {preset}: recurrent state {state_bytes} bytes per "
              "request", file=sys.stderr, flush=True)
        warm = prompts(1, 16, vocab)
        _baton(path, warm, 2)  # first calls pay one-off allocation and dispatch setup
        _hf(path, warm, 2)
        for conc in (1, 8, 32):
            reqs = prompts(conc, prompt_len, vocab, seed=conc)
            baton = _baton(path, reqs, out_len)
            hf = _hf(path, reqs, out_len)
            row = {
                "benchmark": "engine", "label": f"{_short(family)}{preset}-c{conc}",
                "model": preset, "family": family, "state_bytes_per_request": state_bytes,
                "concurrency": conc, "prompt_tokens": prompt_len, "output_tokens": out_len,
                "baton_tok_s": round(baton, 1), "hf_tok_s": round(hf, 1),
                "ratio": round(baton / hf, 2), "target_ratio_at_32": 5.0,
            }
            print(f"[bench engine] {row}", file=sys.stderr, flush=True)
            rows.append(row)
    from bench import moe

    # the RSS ratio means something only for a checkpoint of GBs: not in a quick run
    return rows + moe.run_rows(quick) + ([] if quick else [moe.load_rss_row(quick)])


def _short(family: str) -> str:
    return "" if family == "nemotron_h" else f"{family}-"


def _vocab(path) -> int:
    from baton.model.config import load_config

    return load_config(path).vocab_size


def _state_bytes(path) -> int:
    """Bytes of one request's recurrent state (every state layer, every declared tensor) at
    the bench's float32 model dtype."""
    from baton.model.config import load_config
    from baton.model.pools import PoolSpec

    spec = PoolSpec.for_model(load_config(path), num_blocks=1, tokens_per_block=16, num_slots=1)
    return spec.state_bytes_per_slot()
