"""Accepted length of checkpoints' MTP heads, side by side (greedy, held-out prompts).

    python -m bench.spec_accept code-nemotron_h /tmp/distilled [--ks 1 2 3] [--prompts 32]

Each model decodes the same held-out prompts (bench/spec.py's `heldout_prompts`: 96 tokens,
seed 132, the prompts of `bench spec --model`'s batch-32 rows) at K = 1, 2, 3 with
`bench spec`'s engine config, greedy; a row gives the mean accepted length (tokens emitted
per request per speculative step) and whether the tokens equal speculation off. Greedy
acceptance is a function of the tokens and the head alone, so the load does not change it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def acceptance(path: Path, ks=(1, 2, 3), n: int = 32, prompt_len: int = 96,
               out_len: int = 64, seed: int = 132) -> dict:
    """{"K=k": accepted length, ..., "identical_to_off": bool} for `path`'s own head."""
    from baton.model.layers.linear import set_decode_path
    from bench.spec import _accepted_length, _run, heldout_prompts

    old = set_decode_path("fast")
    try:
        reqs = heldout_prompts(path, n, prompt_len, seed)
        ref = _run(path, reqs, out_len, 0)["out"]
        row, same = {}, True
        for k in ks:
            r = _run(path, reqs, out_len, k)
            row[f"K={k}"] = _accepted_length(r["eng"])
            same = same and r["out"] == ref
        row["identical_to_off"] = same
        return row
    finally:
        set_decode_path(old)


def main(argv=None) -> int:
    import torch

    from baton.model.registry import resolve_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="named models or checkpoint folders")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--seed", type=int, default=132)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for m in a.models:
        row = acceptance(Path(resolve_model(m)), a.ks, a.prompts, a.prompt_len, a.new, a.seed)
        print(json.dumps({"model": m, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
