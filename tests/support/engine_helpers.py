"""Shared helpers for engine-level tests: a seeded checkpoint and engines over it."""

from __future__ import annotations

from pathlib import Path

from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.engine import Engine
from baton.engine.request import Request, SamplingParams


def make_checkpoint(root: Path, name: str = "tiny", **kw) -> Path:
    from baton.model.make_model import write_checkpoint

    return Path(write_checkpoint(root / name, **kw))


def engine_for(model_dir: Path, **sections) -> Engine:
    """An engine over `model_dir` with config sections overridden by plain dicts."""
    data = {k: v for k, v in sections.items()}
    data.setdefault("worker", {})
    data["worker"] = {"max_num_seqs": 16, **data["worker"]}
    data.setdefault("cache", {})
    data["cache"] = {"num_blocks": 512, "num_state_slots": 64, **data["cache"]}
    if "speculative" in data:  # tests draft at any batch size unless they say otherwise
        data["speculative"] = {"max_batch": 0, **data["speculative"]}
    return build_engine(BatonConfig.from_dict(data), str(model_dir))


def run_all(engine: Engine, reqs: list[Request], arrivals: dict[str, int] | None = None) -> dict:
    """Step until all requests finish; `arrivals` delays a request to a given step number."""
    arrivals = arrivals or {}
    outs: dict[str, list[int]] = {r.id: [] for r in reqs}
    pending = list(reqs)
    step = 0
    finished: set[str] = set()
    meta: dict[str, object] = {}
    while len(finished) < len(reqs):
        for r in [r for r in pending if arrivals.get(r.id, 0) <= step]:
            engine.add_request(r)
            pending.remove(r)
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finished.add(o.request_id)
                meta[o.request_id] = o
        step += 1
        assert step < 100_000, "engine made no progress"
    return {"tokens": outs, "outputs": meta}


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def staggered(n: int = 12) -> list[tuple[int, Request]]:
    """(arrival step, request): n requests arriving every 4-5 steps, prompts of 2-20 tokens,
    answers of 8-40 (with blocks of 4 tokens: many block crossings; batches grow and shrink)."""
    import random

    rng = random.Random(3)
    return [(int(i * 4.5), Request(f"q{i}", prompt(i, rng.randrange(2, 21)),
                                   greedy(rng.randrange(8, 41)))) for i in range(n)]


def run_staggered(engine: Engine, workload: list[tuple[int, Request]],
                  max_steps: int = 300) -> dict[str, list[int]]:
    """Step `engine` through `workload` (each request added at its arrival step) until all
    finish; the tokens of each request."""
    pending, tokens = list(workload), {}
    for step in range(max_steps):
        for _, r in [x for x in pending if x[0] <= step]:
            engine.add_request(r)
        pending = [x for x in pending if x[0] > step]
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not pending and not engine.has_work:
            break
    return tokens


def decode_rows(model, pools, rows: list[int], lengths, steps: int, seed: int,
                direct: bool = True) -> list:
    """`steps` decode calls of the sequences `rows` (sequence i: `lengths[i]` tokens in, state
    slot i, blocks 4i..4i+3), a token drawn from `seed` + step each; their logits. `direct`
    False: through the modules (`fast_decode.applies` off), not the fast path's layer runner."""
    import torch

    from baton.model.layers import fast_decode

    applies = fast_decode.applies
    if not direct:
        fast_decode.applies = lambda h, pools: False
    try:
        out = []
        for t in range(steps):
            ids = torch.tensor([prompt(seed + t, 1)[0] for _ in rows])
            pos = torch.tensor([lengths[i] + t for i in rows])
            tables = [list(range(4 * i, 4 * i + 4)) for i in rows]
            out.append(model.decode(ids, pos, tables, torch.tensor(rows), pools))
        return out
    finally:
        fast_decode.applies = applies


def run_alone(engine: Engine, rid: str, ids: list[int], n: int = 8):
    """(tokens, logprobs, cached_tokens) of one greedy request (top logprob kept) run alone."""
    engine.add_request(Request(rid, ids, greedy(n, logprobs=1)))
    toks, lps, cached = [], [], None
    while cached is None:
        for o in engine.step():
            toks += o.new_token_ids
            lps += [lp.logprob for lp in o.logprobs]
            if o.finished:
                cached = o.cached_tokens
    return toks, lps, cached
