"""`baton bench precision`: recurrent state and KV in fewer bits (docs/state-precision.md),
side by side with float32 in one run.

Variants (config sections over the defaults):

    float32            reference: float32 state and KV
    state bf16/fp16    cache.state_dtype, nearest or stochastic rounding (the live state
                       rounded at every policy point: here every ROUND_EVERY tokens)
    kv bf16 / fp8      cache.kv_dtype (state float32)

Per variant: the bytes a request's state takes in the format (`state_format_bytes`) and what
the pools store today (`state_pool_bytes`: a 16-bit state still sits in float32 slots on this
branch), the KV bytes of a 2k-token request, how many state snapshots and KV tokens fit in one
GiB, the handoff bytes of a 2k prompt (KV + state as the format stores them), decode tokens/s
(batch 8 at a 512-token context; `decode_ratio` against float32 measured in the same run), and
quality on the held-out text (baton/train/data/heldout.jsonl) at each context length: the mean
KL(float32 || variant) per token, top-1 agreement and perplexity. Quality runs every window
through the engine's own prefill in chunks that end at the rounding points, rounding the live
state there as a served request's prefill does (`Engine.rounding`), with the same chunk ends
for the reference. Use `--model DIR` for a trained checkpoint: a random one's distributions
are flat, and its KL says little.

Handoff time of a 2k prompt (`handoff_s_2k`, `handoff_time_ratio` against float32): two
processes over NIXL (bench/harness/loopback.py), pools of the model's shapes, float32 KV;
the float32 state goes live slot to live slot, the 16-bit state snapshot slot to snapshot
slot, as a served handoff moves them, round-robin in one run (median of HANDOFF_REPS). A
16-bit handoff also pays its staging copies (the prefill side narrows the rounded state into
the snapshot slot, the decode side widens it into its live slot on landing), timed in this
process on pools of the same shapes and added. The same with bf16 KV on both sides
(`handoff_s_2k_kv_bf16`, float32 and bf16 state) shows what the two together give; both KV
dtypes' process pairs run at once and take turns, so every ratio compares the same moments.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch

ROUND_EVERY = 256
"""Rounding points (the snapshot policy's periodic interval) of the state variants."""
CONTEXTS, QUICK_CONTEXTS = (512, 2048, 8192), (128, 512)
WINDOWS, QUICK_WINDOWS = 2, 1
"""Held-out windows per context length."""
GIB = 1 << 30
CHUNK = 256

VARIANTS: dict[str, dict] = {
    "float32": {},
    "state bf16 nearest": {"state_dtype": "bfloat16"},
    "state bf16 stochastic": {"state_dtype": "bfloat16", "state_rounding": "stochastic"},
    "state fp16 nearest": {"state_dtype": "float16"},
    "state fp16 stochastic": {"state_dtype": "float16", "state_rounding": "stochastic"},
    "kv bf16": {"kv_dtype": "bfloat16"},
    "kv fp8": {"kv_dtype": "float8_e4m3"},
}


def _engine(model_dir: Path, cache: dict, max_len: int, seqs: int = 1):
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine

    tpb = 16
    data = {"worker": {"max_num_seqs": seqs, "max_model_len": max_len + 64,
                       "prefill_chunk_size": CHUNK},
            "cache": {"tokens_per_block": tpb, "num_blocks": seqs * (max_len // tpb + 8),
                      "num_state_slots": seqs + 4, "enable_prefix_reuse": False,
                      "mamba_state_config": {"periodic_snapshot_interval": ROUND_EVERY,
                                             "decode_end_snapshot": False},
                      **cache}}
    return build_engine(BatonConfig.from_dict(data), str(model_dir))


def _windows(model_dir: Path, seq: int, count: int) -> list[list[int]]:
    from baton.model.tokenizer import load_tokenizer
    from baton.train.corpus import heldout

    tok = load_tokenizer(model_dir)
    ids = [t for doc in heldout() for t in tok.encode(doc.text)]
    step = max(seq + 1, (len(ids) - seq - 1) // max(count, 1))
    return [ids[i:i + seq + 1] for i in range(0, len(ids) - seq - 1, step)][:count]


def _chunk_ends(length: int, points) -> list[int]:
    ends, s = [], 0
    marks = sorted(p for p in points if 0 < p < length)
    while s < length:
        e = min(length, s + CHUNK)
        e = next((p for p in marks if s < p < e), e)
        ends.append(e)
        s = e
    return ends


def _log_probs(engine, window: list[int], ends: list[int]) -> torch.Tensor:
    """Every position's log-distribution [seq, vocab]: prefill chunk by chunk, the live state
    rounded at the engine's rounding points (as `Engine._commit_chunk` does)."""
    cache, rid = engine.cache, "precision"
    prompt = window[:-1]
    adm = cache.admit(rid, prompt, reuse=False)
    points = set(engine.rounding.points(len(prompt))) if engine.rounding else set()
    out, s = [], 0
    try:
        cache.ensure_blocks(rid, len(prompt))
        for e in ends:
            logits = engine.model.prefill(torch.tensor(prompt[s:e], device=engine.device), s,
                                          cache.block_table(rid), adm.slot, engine.pools,
                                          all_logits=True)
            out.append(torch.log_softmax(logits.float().cpu(), dim=-1))
            if e in points:
                engine.rounding.round(adm.slot, prompt[:e])
            s = e
    finally:
        cache.abort(rid)
    return torch.cat(out)


def _bytes(engine, ctx: int) -> dict:
    """State and KV bytes of one request of `ctx` tokens in `engine`'s format."""
    from baton.cache.state_format import resolve

    spec = engine.pools.spec
    fmt = resolve(engine.cache.cfg, spec.state_tensors, spec.dtype, str(spec.device))
    state_fmt = len(spec.state_layers) * sum(t.numel * fmt.dtypes[t.name].itemsize
                                             for t in spec.state_tensors)
    kv = -(-ctx // spec.tokens_per_block) * spec.kv_bytes_per_block()
    return {"state_format_bytes": state_fmt, "state_pool_bytes": spec.state_bytes_per_slot(),
            "kv_bytes_2k": -(-2048 // spec.tokens_per_block) * spec.kv_bytes_per_block(),
            "snapshots_per_gib": GIB // max(state_fmt, 1),
            "kv_tokens_per_gib": GIB * spec.tokens_per_block // max(spec.kv_bytes_per_block(), 1),
            "handoff_bytes_2k": -(-2048 // spec.tokens_per_block) * spec.kv_bytes_per_block()
            + state_fmt, "kv_bytes_at_ctx": kv}


def _decode_speed(model_dir: Path, cache: dict, batch: int, ctx: int, steps: int) -> float:
    """Decode tokens per CPU second of this process (every thread's; prefill not counted) of
    `batch` requests of `ctx`-token prompts: on a machine shared with other work, wall-clock
    rates drift with the load, CPU seconds much less (as bench spec measures)."""
    from baton.engine.request import Request, SamplingParams

    eng = _engine(model_dir, cache, ctx + steps + 8, seqs=batch)
    vocab = eng.model.config.vocab_size
    for i in range(batch):
        ids = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(ctx)]
        eng.add_request(Request(f"d{i}", ids, SamplingParams(max_tokens=steps, ignore_eos=True)))
    while not all(r.num_computed >= r.prompt_len for r in eng.requests.values()):
        eng.step()
    for _ in range(4):  # warm: first calls of a geometry (compiled steps, caches)
        eng.step()
    t0, tokens = time.process_time(), 0
    while eng.requests:
        tokens += sum(len(o.new_token_ids) for o in eng.step())
    return tokens / max(time.process_time() - t0, 1e-9)


HANDOFF_TOKENS, HANDOFF_REPS = 2048, 15


def _handoff_pairs(model: dict, kv_dtypes: tuple, reps: int, backend: str = "nixl"
                   ) -> dict[tuple, tuple]:
    """Median seconds and bytes of a HANDOFF_TOKENS-prompt handoff between two processes, by
    (KV dtype, state dtype) ("float32": live slot 0 -> 1; "bfloat16": snapshot slot 2 -> 3).
    One pair of processes per KV dtype, all started first; the variants then run round-robin
    (a round: every KV dtype, every state dtype), so that every ratio compares handoffs of
    the same moments of a loaded machine."""
    from baton.model.config import config_from_dict
    from bench.harness.loopback import StageProc
    from bench.transfer import _ok

    mc, tpb = config_from_dict(model), 16
    n = -(-HANDOFF_TOKENS // tpb)
    procs: dict = {}
    try:
        for kv in kv_dtypes:
            common = dict(backend=backend, model=model, layers=list(range(mc.num_layers)),
                          num_blocks=n + 1, tokens_per_block=tpb, num_slots=4,
                          dtype="float32", snapshots=[2, "bfloat16"], kv_dtype=kv)
            dec, pre = StageProc(), StageProc()
            procs[kv] = (dec, pre)
            ep = _ok(dec.call("setup", role="decode", seed=-1, **common, timeout=300))[
                "endpoint"]
            _ok(pre.call("setup", role="prefill", seed=3, **common, timeout=300))
            procs[kv] = (dec, pre, ep)
        blocks, slots = list(range(n)), {"float32": (0, 1), "bfloat16": (2, 3)}
        times: dict[tuple, list[float]] = {(kv, k): [] for kv in kv_dtypes for k in slots}
        nbytes, rids = {}, {kv: [] for kv in kv_dtypes}
        for r in range(reps + 1):  # round-robin; the first round warms up
            for kv, (dec, pre, ep) in procs.items():
                for name, (ss, ds) in slots.items():
                    rid = f"{name}-{r}"
                    rids[kv].append(rid)
                    _ok(dec.call("expect", rid=rid, blocks=blocks, slot=ds))
                    res = _ok(pre.call("bench_send", endpoint=ep, src_blocks=blocks,
                                       src_slot=ss, dst_blocks=blocks, dst_slot=ds, rids=[rid],
                                       capture=False, timeout=120))
                    nbytes[kv, name] = res["bytes"]
                    if r:
                        times[kv, name].append(res["times"][0])
        for kv, (dec, _, _) in procs.items():
            evs = _ok(dec.call("wait", rids=rids[kv], timeout=60))["events"]
            if len(evs) != len(rids[kv]) or not all(ok for _, ok, _ in evs):
                raise RuntimeError(f"handoff bench: not every handoff was delivered: {evs[:4]}")
    finally:
        for p in procs.values():
            p[0].stop()
            p[1].stop()
    return {k: (statistics.median(v), nbytes[k]) for k, v in times.items()}


def _staging_s(model: dict, reps: int) -> float:
    """Median seconds of a 16-bit handoff's two staging copies (narrow a float32 live slot
    into a bf16 snapshot slot, widen it back), on pools of the model's shapes, one torch
    thread (on a loaded machine a second thread's wake-up costs more than the copy)."""
    from baton.model.config import config_from_dict
    from baton.model.pools import Pools, PoolSpec

    spec = PoolSpec.for_model(config_from_dict(model), num_blocks=1, tokens_per_block=16,
                              num_slots=4)
    pools = Pools(spec.split_snapshots(2, {t.name: torch.bfloat16
                                           for t in spec.state_tensors}))
    out, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            pools.copy_slot(0, 2)
            pools.copy_slot(2, 1)
            out.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(out[1:])


def handoff_times(model_dir: Path, reps: int = HANDOFF_REPS, kv_bf16: bool = True) -> dict:
    """(seconds, bytes moved) of a 2k prompt's handoff by state dtype, "float32" and
    "bfloat16" (staging copies included), with float32 KV, then with bf16 KV (`_kv_bf16`
    keys, unless `kv_bf16` is False); `staging_s` the staging copies alone."""
    import json

    model = json.loads((Path(model_dir) / "config.json").read_text())
    stage = _staging_s(model, reps)
    out = {"staging_s": stage}
    kvs = ((None, ""), ("bfloat16", "_kv_bf16"))[: 2 if kv_bf16 else 1]
    got = _handoff_pairs(model, tuple(kv for kv, _ in kvs), reps)
    for kv, name in kvs:
        out[f"float32{name}"] = got[kv, "float32"]
        out[f"bfloat16{name}"] = (got[kv, "bfloat16"][0] + stage, got[kv, "bfloat16"][1])
    return out


DECODE_VARIANTS = ("float32", "kv bf16", "kv fp8", "state bf16 stochastic")
ROUNDS = 3
"""Decode rows measured round-robin ROUNDS times; each variant's median round counts."""


def measure(model_dir: Path, contexts, windows: int, decode: tuple[int, int, int],
            handoff_reps: int = HANDOFF_REPS) -> list[dict]:
    """`handoff_reps` 0: the handoff times are left out."""
    rows = {name: {"variant": name, "config": {"cache": c}, "model": str(model_dir)}
            for name, c in VARIANTS.items()}
    top = max(contexts)
    engines = {name: _engine(model_dir, c, top) for name, c in VARIANTS.items()}
    for name, eng in engines.items():
        rows[name].update(_bytes(eng, top))
    base = rows["float32"]
    for row in rows.values():
        row["state_bytes_ratio"] = row["state_format_bytes"] / base["state_format_bytes"]
        row["kv_bytes_ratio"] = row["kv_bytes_2k"] / max(base["kv_bytes_2k"], 1)
    for ctx in contexts:
        wins = _windows(model_dir, ctx, windows)
        ref_eng, names = engines["float32"], [n for n in VARIANTS if n != "float32"]
        acc = {n: {"kl": 0.0, "agree": 0.0, "nll": 0.0} for n in VARIANTS}
        n_tok = 0
        for w in wins:
            points = engines["state bf16 nearest"].rounding.points(len(w) - 1) \
                if engines["state bf16 nearest"].rounding else ()
            ends = _chunk_ends(len(w) - 1, points)
            target = torch.tensor(w[1:])
            lp_r = _log_probs(ref_eng, w, ends)
            acc["float32"]["nll"] -= float(lp_r.gather(1, target[:, None]).sum())
            for n in names:
                lp = _log_probs(engines[n], w, ends)
                acc[n]["nll"] -= float(lp.gather(1, target[:, None]).sum())
                acc[n]["kl"] += float((lp_r.exp() * (lp_r - lp)).sum())
                acc[n]["agree"] += float((lp_r.argmax(-1) == lp.argmax(-1)).sum())
            n_tok += len(target)
        for n in VARIANTS:
            r = rows[n]
            r[f"ppl_{ctx}"] = math.exp(acc[n]["nll"] / max(n_tok, 1))
            if n != "float32":
                r[f"kl_{ctx}"] = acc[n]["kl"] / max(n_tok, 1)
                r[f"top1_{ctx}"] = acc[n]["agree"] / max(n_tok, 1)
                r[f"ppl_ratio_{ctx}"] = r[f"ppl_{ctx}"] / rows["float32"][f"ppl_{ctx}"]
        for r in rows.values():
            r[f"windows_{ctx}"] = len(wins)
    del engines
    ho = handoff_times(model_dir, handoff_reps) if handoff_reps else None
    ref_s = ho["float32"][0] if ho else 0.0
    for name, r in rows.items() if ho else ():
        state16 = name.startswith("state ")
        # fp8 KV is not timed here; the kv bf16 row has the bf16-KV fields only
        for suffix in {"kv bf16": ("_kv_bf16",), "kv fp8": ()}.get(name, ("", "_kv_bf16")):
            s_, b_ = ho[("bfloat16" if state16 else "float32") + suffix]
            r[f"handoff_s_2k{suffix}"] = s_
            r[f"handoff_moved_bytes_2k{suffix}"] = b_
            r[f"handoff_time_ratio{suffix}"] = s_ / max(ref_s, 1e-12)
        if state16:
            r["handoff_staging_s"] = ho["staging_s"]
    batch, ctx, steps = decode
    speeds: dict[str, list[float]] = {n: [] for n in DECODE_VARIANTS}
    for _ in range(ROUNDS):
        for name in DECODE_VARIANTS:
            speeds[name].append(_decode_speed(model_dir, VARIANTS[name], batch, ctx, steps))
    ref = statistics.median(speeds["float32"])
    for name, s in speeds.items():
        rows[name]["decode_tok_per_cpu_s"] = statistics.median(s)
        rows[name]["decode_rounds"] = s
        rows[name]["decode_ratio"] = statistics.median(s) / max(ref, 1e-9)
    return list(rows.values())


def run(args) -> list[dict]:
    """The variants' rows, then the whole-chat rows (bench/precision_chats.py: decode-end
    reuse on against off, by state format)."""
    from baton.model.registry import resolve_model
    from bench import precision_chats

    model_dir = resolve_model(getattr(args, "model", None) or "tiny")
    if args.quick:
        rows = measure(model_dir, QUICK_CONTEXTS, QUICK_WINDOWS, (4, 128, 16), 5)
        return rows + precision_chats.run_model(model_dir, *precision_chats.QUICK)
    rows = measure(model_dir, CONTEXTS, WINDOWS, (8, 512, 64))
    return rows + precision_chats.run_model(model_dir)
