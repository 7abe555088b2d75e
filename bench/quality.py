"""`baton bench quality`: what a variant of the engine does to the model's predictions, over
the committed held-out text (baton/train/data/heldout.jsonl), side by side with the float32
reference in one run.

    reference  the default config (float32 weights, state and KV)
    variant    --variant FILE.yaml (config sections over the defaults; default: model.dtype
               bfloat16), e.g. a weight format, a state or KV dtype

Both engines compute every position's full distribution with their own prefill forward (the
engine's model, pools and cache blocks: the numerics a served request gets), window by window
(--quick: fewer, shorter ones). Per engine: per-token perplexity and bits per byte of the
held-out text; for the variant also the mean KL divergence KL(reference || variant) per token
and the top-1 agreement (argmax equal to the reference's). Speculative decoding changes no
distribution (its tokens equal speculation off: bench spec and the identity tests check that).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

DEFAULT_VARIANT = {"model": {"dtype": "bfloat16"}}


def _engine(model_dir: Path, sections: dict):
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine

    data = {**sections}
    data["worker"] = {"max_num_seqs": 1, **data.get("worker", {})}
    return build_engine(BatonConfig.from_dict(data), str(model_dir))


def _windows(model_dir: Path, seq: int, max_windows: int) -> tuple[list[list[int]], list[int]]:
    """Held-out windows of seq + 1 token ids (file by file) and the UTF-8 bytes each window's
    predicted tokens stand for."""
    from baton.model.tokenizer import load_tokenizer
    from baton.train.corpus import heldout

    tok = load_tokenizer(model_dir)
    wins, nbytes = [], []
    for doc in heldout():
        ids = tok.encode(doc.text)
        for i in range(0, len(ids) - seq - 1, seq):
            w = ids[i : i + seq + 1]
            wins.append(w)
            nbytes.append(len(tok.decode(w[1:]).encode()))
            if len(wins) == max_windows:
                return wins, nbytes
    return wins, nbytes


def _log_probs(engine, window: list[int]) -> torch.Tensor:
    """Every position's log-distribution [seq, vocab] from the engine's prefill forward over
    cache blocks and a state slot it allocates (and frees) for the window."""
    cache, rid = engine.cache, "quality"
    prompt = window[:-1]
    adm = cache.admit(rid, prompt, reuse=False)
    try:
        cache.ensure_blocks(rid, len(prompt))
        logits = engine.model.prefill(torch.tensor(prompt, device=engine.device), 0,
                                      cache.block_table(rid), adm.slot, engine.pools,
                                      all_logits=True)
    finally:
        cache.abort(rid)
    return torch.log_softmax(logits.float().cpu(), dim=-1)


class Tally:
    """One engine's sums over windows: its negative log-likelihood of the next tokens and,
    against a reference's log-probs at the same positions, KL(reference || it) and how often
    the two argmaxes agree."""

    def __init__(self):
        self.nll = self.kl = self.agree = 0.0
        self.tokens = 0

    def add(self, lp: torch.Tensor, target: torch.Tensor, lp_ref: torch.Tensor | None = None):
        """`lp` [seq, vocab] log-probs, `target` [seq] the next token ids."""
        self.nll -= float(lp.gather(1, target[:, None]).sum())
        self.tokens += len(target)
        if lp_ref is not None:
            self.kl += float((lp_ref.exp() * (lp_ref - lp)).sum())
            self.agree += float((lp_ref.argmax(-1) == lp.argmax(-1)).sum())

    def metrics(self, total_bytes: int | None = None, compared: bool = True) -> dict:
        out = {"tokens": self.tokens, "perplexity": math.exp(self.nll / self.tokens)}
        if total_bytes:
            out["bits_per_byte"] = self.nll / math.log(2) / total_bytes
        if compared:
            out |= {"mean_kl": self.kl / self.tokens,
                    "top1_agreement": self.agree / self.tokens}
        return out


def measure(model_dir: Path, variant: dict, seq: int, max_windows: int) -> list[dict]:
    wins, nbytes = _windows(model_dir, seq, max_windows)
    ref, var = _engine(model_dir, {}), _engine(model_dir, variant)
    tally = {"reference": Tally(), "variant": Tally()}
    for w in wins:
        target = torch.tensor(w[1:])
        lp_r, lp_v = _log_probs(ref, w), _log_probs(var, w)
        tally["reference"].add(lp_r, target)
        tally["variant"].add(lp_v, target, lp_r)
    rows = []
    for name in ("reference", "variant"):
        rows.append({"engine": name, "config": {} if name == "reference" else variant,
                     "model": str(model_dir), "windows": len(wins),
                     **tally[name].metrics(sum(nbytes), compared=name == "variant")})
    return rows


def run(args) -> list[dict]:
    import yaml

    from baton.model.registry import resolve_model

    model_dir = resolve_model(getattr(args, "model", None) or "tiny")
    variant = DEFAULT_VARIANT
    if getattr(args, "variant", None):
        variant = yaml.safe_load(Path(args.variant).read_text()) or {}
    seq, windows = (128, 4) if args.quick else (512, 48)
    return measure(model_dir, variant, seq, windows)
