"""`baton bench engine --peer llamacpp`: Baton and llama.cpp side by side on one checkpoint.

First greedy agreement (3 prompts; the first divergence and both engines' logit margin there),
then, engines alternating, the same thread count (1 and 2) for both: prefill of a 2,048-token
prompt, and decode at batch 1, 8 and 32 (one batched forward per step in both engines; the
prompts' prefill is outside the timed steps), each as wall time and CPU seconds per token,
median of `repeats`. `ratio` = Baton speed / llama.cpp speed (above 1: Baton is faster);
`cpu_ratio` the same in CPU time per token. Rooflines are in bench/roofline.py.

At equal bits (`PAIRS`): Baton's `model.quantize: int8` against llama.cpp's Q8_0, Baton's
int4 against Q4_0 and Q4_K_M (llama.cpp's own quantizer), the same workloads and threads,
each Baton engine alternating with its peers; then each engine's peak resident memory (VmHWM
of a fresh process of its own that loads the model, prefills the 2k prompt and decodes a
batch of 32), and quality on the held-out text (bench/quality.py's windows and metrics): KL
from Baton's float32, top-1 agreement and perplexity of every format, llama.cpp's through its
own logits of every position (`logits_all`) on the same token ids. Baton's fp8 (the family's
published FP8 layout, `FP8_LAYOUT`) is timed and scored against Baton at bf16 weights.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from bench import llamacpp_peer as peer
from bench.common import checkpoint, decode_engine, prompts
from bench.roofline import matmul_peak_gflops, prefill_flops, roofline_rows, side_by_side

FAMILIES = {"nemotron_h": ("100m", ()), "qwen3_5": ("100m", ("--no-mtp",)),
            "nemotron_h_moe": ("moe", ()), "qwen3_5_moe": ("100m", ("--no-mtp",))}
"""Family -> (bench checkpoint preset, extra converter flags: the bench Qwen3.5 models have no
MTP head). `nemotron_h_moe` is `bench moe`'s 18-layer MoE model (100m widths, 32 experts, 4
active); the Qwen3.5-MoE one is its family's 100m preset (8 experts, 2 active)."""


PAIRS = (("int8", "q8_0"), ("int4", "q4_0"), ("int4", "q4_k_m"),
         ("int8a8e", "q8_0"), ("int4a8e", "q4_0"), ("int4a8e", "q4_k_m"))
"""(Baton format, llama.cpp GGUF type) compared at equal bits: `int8` / `int4` are
`model.quantize` (exact against the dequantized weights; embeddings and LM head float32);
`a8` adds `model.quantize_activations: int8` (integer dot products, as llama.cpp computes),
`e` `model.quantize_embeddings: int8` (embeddings and LM head int8, as llama.cpp keeps them
quantized)."""

QUALITY_ONLY = ("int8a8", "int4a8", "int8e")
"""Formats scored for quality only: what each option costs on its own."""


def model_section(fmt: str) -> dict:
    """The `model` config section of a Baton format of `PAIRS` (or float32 / bf16)."""
    if fmt == "bf16":
        return {"weight_dtype": "bfloat16"}
    if fmt == "float32":
        return {"quantize": None}
    base, rest = fmt[:4], fmt[4:]
    if base not in ("int8", "int4") or rest not in ("", "a8", "e", "a8e"):
        raise ValueError(f"bench format {fmt!r}: int8 / int4, then a8 and / or e")
    return {"quantize": base} | ({"quantize_activations": "int8"} if "a8" in rest else {}) \
        | ({"quantize_embeddings": "int8"} if rest.endswith("e") else {})

TARGETS = {"prefill": 1.2, 1: 1.0, 8: 1.5}
"""Issue 49's speed targets, Baton speed / llama.cpp speed at equal bits (decode by batch)."""

FP8_LAYOUT = {"nemotron_h": "modelopt_fp8", "nemotron_h_moe": "modelopt_fp8",
              "qwen3_5": "qwen_fp8", "qwen3_5_moe": "qwen_fp8"}
"""The FP8 checkpoint each family is published in (NVIDIA ModelOpt per tensor; Qwen's 128 x 128
tiles), written from the bench checkpoint by bench/quant_layouts.py: Baton serves it
packed (fp8 read as stored) and is compared with itself at bf16 weights
(`model.weight_dtype: bfloat16`), llama.cpp having no fp8 type."""

RSS_TARGET = 1.1
"""Baton's peak RSS over llama.cpp's at equal bits, at most."""


def _checkpoint(family: str, preset: str):
    if family == "nemotron_h_moe":
        from bench.moe import checkpoints

        return checkpoints(quick=False)["moe"]
    return checkpoint(preset, family)


def sizes(quick: bool) -> dict:
    if quick:
        return dict(prefill=256, decode={1: (64, 16), 8: (64, 16)}, repeats=1,
                    greedy=((16, 8), (64, 8)), threads=(1,), quality=(128, 2))
    # batch: (prompt tokens, timed steps); batch 32 uses shorter prompts to keep the run short
    return dict(prefill=2048, decode={1: (512, 128), 8: (512, 128), 32: (128, 64)}, repeats=3,
                greedy=((16, 32), (200, 32), (1000, 32)), threads=(1, 2), quality=(512, 16))


def run(args) -> list[dict]:
    from baton.model.layers.linear import set_decode_path

    set_decode_path("fast")  # what is measured: the optimised decode path (the default)
    sz = sizes(getattr(args, "quick", False))
    try:
        py = peer.ensure_venv()
    except peer.PeerUnavailable as e:
        print(f"[bench engine] peer llamacpp skipped: {e}", file=sys.stderr, flush=True)
        return [{"benchmark": "engine", "peer": "llamacpp", "skipped": str(e)}]
    rows = []
    for family, (preset, flags) in FAMILIES.items():
        path = _checkpoint(family, preset)
        try:
            rows += _family(family, path, py, sz, flags)
            rows += equal_bits(family, path, py, sz, flags)
        except peer.PeerUnavailable as e:
            print(f"[bench engine] {family} skipped: {e}", file=sys.stderr, flush=True)
            rows.append({"benchmark": "engine", "peer": "llamacpp", "family": family,
                         "skipped": str(e)})
    return rows


def _family(family: str, path, py, sz, flags: tuple[str, ...]) -> list[dict]:
    from baton.model.loader import load_model

    gguf = {t: peer.convert(path, t, flags) for t in ("f32", "f16")}
    vocab = _vocab(path)
    rows = []
    torch.set_num_threads(1)
    model = load_model(path)
    w = peer.Worker(py, gguf["f32"], 1, 1, 4096)
    try:
        rows += [_greedy(model, w, family, vocab, n, steps, i)
                 for i, (n, steps) in enumerate(sz["greedy"])]
    finally:
        w.close()
    n_ctx = max(sz["prefill"], *(b * (p + s + 16) for b, (p, s) in sz["decode"].items()))
    for threads in sz["threads"]:
        torch.set_num_threads(threads)
        workers = {t: peer.Worker(py, g, threads, max(sz["decode"]), n_ctx + 256)
                   for t, g in gguf.items()}
        try:
            rows += _measure(family, path, vocab, threads, workers, sz)
        finally:
            for x in workers.values():
                x.close()
    rows += roofline_rows(family, model, rows, sz)
    return rows


def _greedy(model, w, family, vocab, n, steps, seed) -> dict:
    prompt = prompts(1, n, vocab, seed=100 + seed)[0]
    ours, our_margins = baton_greedy(model, prompt, steps)
    theirs = w.call("greedy", prompt=prompt, steps=steps)
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs["tokens"], strict=True))
                  if a != b), None)
    row = {"benchmark": "engine", "peer": "llamacpp", "family": family, "label":
           f"{family}-greedy-{n}", "prompt_tokens": n, "steps": steps,
           "agree": steps if first is None else first, "first_divergence": first}
    if first is not None:
        row["baton_margin"] = round(our_margins[first], 4)
        row["llamacpp_margin"] = round(theirs["margins"][first], 4)
    print(f"[bench engine] {row}", file=sys.stderr, flush=True)
    return row


@torch.inference_mode()
def baton_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of `model` after `prompt`, and the top-1 minus top-2 logit of each."""
    tpb = 16
    need = -(-(len(prompt) + steps + 1) // tpb)
    pools = model.make_pools(need, tpb, 2)
    table = list(range(need))
    logits = model.prefill(torch.tensor(prompt), 0, table, 1, pools)
    toks, margins = [], []
    for i in range(steps):
        top = torch.topk(logits.reshape(-1), 2)
        toks.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        pos = torch.tensor([len(prompt) + i])
        logits = model.decode(torch.tensor([toks[-1]]), pos, [table], torch.tensor([1]), pools)
    return toks, margins


def _measure(family, path, vocab, threads, workers, sz) -> list[dict]:
    rows = [_prefill_row(family, path, vocab, threads, workers, sz)]
    for batch, (plen, steps) in sz["decode"].items():
        rows.append(_decode_row(family, path, vocab, threads, workers, sz, batch, plen, steps))
    return rows


def _prefill_row(family, path, vocab, threads, workers, sz) -> dict:
    prompt = prompts(1, sz["prefill"], vocab, seed=7)[0]
    eng = _engine(path, 1, sz["prefill"] + 2)
    _baton_prefill(eng, prompt[:64])  # warm: one-off allocations and dispatch
    hidden = eng.model.config.hidden_size

    def ours_then_peak():  # the roofline's matmul peak right after each run: the same moment
        r = _baton_prefill(eng, prompt)
        return r | {"peak_gflops": matmul_peak_gflops(sz["prefill"], hidden, 4 * hidden)}
    ours, theirs = _alternate(sz["repeats"], ours_then_peak,
                              lambda: workers["f32"].call("prefill", prompt=prompt))
    row = _row(family, f"prefill-{sz['prefill']}", threads, sz["prefill"], ours, theirs,
               "prefill")
    flops = prefill_flops(eng.model, sz["prefill"])
    row["side_by_side"] = {
        "peak_gflops": round(statistics.median(r["peak_gflops"] for r in ours), 1),
        "fraction": round(statistics.median(flops / r["cpu_s"] / 1e9 / r["peak_gflops"]
                                            for r in ours), 4)}
    print(f"[bench engine] {row}", file=sys.stderr, flush=True)
    return row


def _decode_row(family, path, vocab, threads, workers, sz, batch, plen, steps) -> dict:
    reqs = prompts(batch, plen, vocab, seed=batch)
    eng = _engine(path, batch, plen + steps + 2)
    _baton_decode(eng, [r[:16] for r in reqs], 4)
    ours, theirs = _alternate(sz["repeats"], lambda: _baton_decode(eng, reqs, steps),
                              lambda: workers["f32"].call("decode", prompts=reqs, steps=steps))
    row = _row(family, f"decode-b{batch}", threads, batch * steps, ours, theirs, "decode",
               prompt_tokens=plen, steps=steps, batch=batch)
    # the roofline's step over its linears, the two alternating on this engine and batch
    row["side_by_side"] = {k: round(v, 6) for k, v in side_by_side(eng, reqs).items()}
    if batch <= 8:  # both engines with f16 weights (Baton's `model.weight_dtype: float16`)
        del eng
        half = _engine(path, batch, plen + steps + 2, weight_dtype="float16")
        _baton_decode(half, [r[:16] for r in reqs], 4)
        ours16, f16 = _alternate(sz["repeats"], lambda: _baton_decode(half, reqs, steps),
                                 lambda: workers["f16"].call("decode", prompts=reqs, steps=steps))
        h = _row(family, "", threads, batch * steps, ours16, f16, "decode")
        row |= {"baton_f16_tok_s": h["baton_tok_s"], "llamacpp_f16_tok_s": h["llamacpp_tok_s"],
                "baton_f16_cpu_ms_per_token": h["baton_cpu_ms_per_token"],
                "llamacpp_f16_cpu_ms_per_token": h["llamacpp_cpu_ms_per_token"],
                "f16_ratio": h["ratio"], "f16_cpu_ratio": h["cpu_ratio"]}
    print(f"[bench engine] {row}", file=sys.stderr, flush=True)
    return row


def _alternate(repeats: int, a, b) -> tuple[list[dict], list[dict]]:
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(a())
        theirs.append(b())
    return ours, theirs


def _per_token(x: dict, tokens: int) -> dict:
    n = x.get("tokens", tokens)
    return {"wall_s": x["wall_s"] / n, "cpu_s": x["cpu_s"] / n,
            "wait": x.get("wait_s", 0.0) / x["wall_s"]}


def _median(xs: list[dict], key: str) -> float:
    return statistics.median(x[key] for x in xs)


def _row(family, work, threads, tokens, ours, theirs, kind, **extra) -> dict:
    """Per-token medians of both sides; `tokens` per run unless a run says how many it timed."""
    ours = [_per_token(x, tokens) for x in ours]
    theirs = [_per_token(x, tokens) for x in theirs]
    bw, lw = _median(ours, "wall_s"), _median(theirs, "wall_s")
    bc, lc = _median(ours, "cpu_s"), _median(theirs, "cpu_s")
    row = {"benchmark": "engine", "peer": "llamacpp", "family": family,
           "label": f"{family}-{work}-t{threads}", "work": kind, "threads": threads, **extra}
    if kind == "prefill":
        row |= {"baton_ms": round(bw * tokens * 1e3, 1),
                "llamacpp_ms": round(lw * tokens * 1e3, 1)}
    row |= {"baton_tok_s": round(1 / bw, 1), "llamacpp_tok_s": round(1 / lw, 1),
            "baton_cpu_ms_per_token": round(bc * 1e3, 3),
            "llamacpp_cpu_ms_per_token": round(lc * 1e3, 3),
            "ratio": round(lw / bw, 3), "cpu_ratio": round(lc / bc, 3),
            # Share of wall time spent runnable but waiting for a CPU (a loaded machine):
            # where it is high, `cpu_ratio` is the comparison to trust.
            "baton_wait_frac": round(_median(ours, "wait"), 3),
            "llamacpp_wait_frac": round(_median(theirs, "wait"), 3)}
    return row


def _engine(path, batch: int, seq_len: int, weight_dtype: str = "float32"):
    return decode_engine(path, batch, seq_len, max_batch_tokens=2048, weight_dtype=weight_dtype)


def _baton_prefill(eng, prompt: list[int]) -> dict:
    from baton.engine.request import Request, SamplingParams

    eng.add_request(Request("p", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    w0, c0, t0 = _waited(), time.process_time(), time.perf_counter()
    while eng.has_work:
        eng.step()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "wait_s": _waited() - w0}


def _baton_decode(eng, reqs: list[list[int]], steps: int) -> dict:
    """Time `steps` decode steps of all of `reqs` at once, after all their prefills."""
    from baton.engine.request import Request, SamplingParams

    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for i, p in enumerate(reqs):
        eng.add_request(Request(f"d{i}", p, sp))
    seen: set[str] = set()
    before = 0
    while len(seen) < len(reqs):  # prefill (and any decode mixed into it) is not timed
        outs = eng.step()
        seen |= {o.request_id for o in outs if o.new_token_ids}
        before += sum(len(o.new_token_ids) for o in outs)
    # Every request has its first token: the rest are pure decode steps of the whole batch.
    produced = 0
    w0, c0, t0 = _waited(), time.process_time(), time.perf_counter()
    while eng.has_work:
        produced += sum(len(o.new_token_ids) for o in eng.step())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert produced + before == len(reqs) * (steps + 1), (produced, before)
    return {"wall_s": wall, "cpu_s": cpu, "wait_s": _waited() - w0, "tokens": produced}


def _waited() -> float:
    """Seconds this process's threads waited for a CPU: other load on the machine."""
    import os

    from bench.common import runqueue_wait_seconds

    return runqueue_wait_seconds(os.getpid())


def _vocab(path) -> int:
    import json

    return json.loads((path / "config.json").read_text())["vocab_size"]


# ---- at equal bits --------------------------------------------------------------------------

def equal_bits(family: str, path, py, sz, flags: tuple[str, ...] = ()) -> list[dict]:
    """The `PAIRS` rows of one family: speed at each thread count, peak RSS, quality; and
    Baton fp8 against Baton bf16 (speed, quality)."""
    gtypes = sorted({g for _, g in PAIRS})
    ggufs = {g: peer.gguf(path, g, flags, py) for g in gtypes}
    vocab = _vocab(path)
    engines = {f: _bits_engine(path, f, sz) for f in dict.fromkeys(f for f, _ in PAIRS)}
    fp8 = fp8_checkpoint(family, path)
    halves = {"fp8": _bits_engine(fp8, "float32", sz), "bf16": _bits_engine(path, "bf16", sz)}
    n_ctx = max(sz["prefill"], *(b * (p + s + 16) for b, (p, s) in sz["decode"].items()))
    rows = []
    for threads in sz["threads"]:
        torch.set_num_threads(threads)
        workers = {g: peer.Worker(py, ggufs[g], threads, max(sz["decode"]), n_ctx + 256)
                   for g in gtypes}
        try:
            rows += _bits_speed(family, vocab, threads, engines, workers, sz)
        finally:
            for x in workers.values():
                x.close()
        rows += _fp8_speed(family, vocab, threads, halves, sz)
    del engines, halves
    torch.set_num_threads(1)
    rows += _bits_rss(family, path, py, ggufs, vocab, sz, n_ctx)
    rows += _bits_quality(family, path, py, flags, sz, fp8)
    return rows


def fp8_checkpoint(family: str, path: Path) -> Path:
    """`path` written in its family's published FP8 layout (FP8_LAYOUT), cached beside it."""
    from bench.quant_layouts import write

    out = path.parent / f"{path.name}-{FP8_LAYOUT[family]}"
    if not (out / "config.json").is_file():
        tmp = path.parent / f"{out.name}.part"
        write(path, tmp, FP8_LAYOUT[family])
        tmp.rename(out)
    return out


def _fp8_speed(family, vocab, threads, halves, sz) -> list[dict]:
    """Baton's packed fp8 checkpoint against Baton at bf16 weights, taking turns."""
    rows = []
    prompt = prompts(1, sz["prefill"], vocab, seed=7)[0]
    for eng in halves.values():
        _baton_prefill(eng, prompt[:64])
    runs = _alternate_many(sz["repeats"], {k: partial(_baton_prefill, e, prompt)
                                           for k, e in halves.items()})
    rows.append(_say(fp8_row(family, "prefill", threads, sz["prefill"], runs, "prefill")))
    for batch, (plen, steps) in sz["decode"].items():
        reqs = prompts(batch, plen, vocab, seed=batch)
        for eng in halves.values():
            _baton_decode(eng, [r[:16] for r in reqs], 4)
        runs = _alternate_many(sz["repeats"], {k: partial(_baton_decode, e, reqs, steps)
                                               for k, e in halves.items()})
        rows.append(_say(fp8_row(family, f"decode-b{batch}", threads, batch * steps, runs,
                                 "decode", prompt_tokens=plen, steps=steps, batch=batch)))
    return rows


def fp8_row(family, work, threads, tokens, runs: dict, kind, **extra) -> dict:
    """`_row` of Baton fp8 (`runs["fp8"]`) against Baton bf16 (`runs["bf16"]`): its
    `baton_` / `llamacpp_` fields named `fp8_` / `bf16_`; `ratio` = fp8 speed / bf16 speed."""
    row = _row(family, f"{work}-fp8-vs-bf16", threads, tokens, runs["fp8"], runs["bf16"], kind,
               **extra)
    row = {k.replace("baton_", "fp8_", 1).replace("llamacpp_", "bf16_", 1): v
           for k, v in row.items()}
    return row | {"peer": "baton-bf16", "baton_format": "fp8", "vs_format": "bf16"}


def _bits_speed(family, vocab, threads, engines, workers, sz) -> list[dict]:
    rows = []
    prompt = prompts(1, sz["prefill"], vocab, seed=7)[0]
    for fmt, eng in engines.items():
        _baton_prefill(eng, prompt[:64])  # warm
        runs = _pair_runs(fmt, sz["repeats"], partial(_baton_prefill, eng, prompt),
                          partial(_peer_call, workers, "prefill", prompt=prompt))
        rows += [_say(bits_row(family, "prefill", threads, sz["prefill"], fmt, g, runs["baton"],
                               runs[g], "prefill"))
                 for f, g in PAIRS if f == fmt]
    for batch, (plen, steps) in sz["decode"].items():
        reqs = prompts(batch, plen, vocab, seed=batch)
        for fmt, eng in engines.items():
            _baton_decode(eng, [r[:16] for r in reqs], 4)  # warm
            runs = _pair_runs(fmt, sz["repeats"], partial(_baton_decode, eng, reqs, steps),
                              partial(_peer_call, workers, "decode", prompts=reqs, steps=steps))
            rows += [_say(bits_row(family, f"decode-b{batch}", threads, batch * steps, fmt, g,
                                   runs["baton"], runs[g], "decode", prompt_tokens=plen,
                                   steps=steps, batch=batch))
                     for f, g in PAIRS if f == fmt]
    return rows


def _pair_runs(fmt: str, repeats: int, ours, theirs) -> dict[str, list[dict]]:
    """Baton's runs (`ours()`) and each of `fmt`'s peers' (`theirs(gtype)`), taking turns."""
    sides = {"baton": ours} | {g: partial(theirs, g) for f, g in PAIRS if f == fmt}
    return _alternate_many(repeats, sides)


def _peer_call(workers: dict, op: str, gtype: str, **args) -> dict:
    return workers[gtype].call(op, **args)


def bits_row(family, work, threads, tokens, fmt, gtype, ours, theirs, kind, **extra) -> dict:
    """`_row` of Baton's `fmt` against llama.cpp's `gtype`, with the issue's target where it
    sets one (`met`: the wall-time ratio reaches it)."""
    row = _row(family, f"{work}-{fmt}-vs-{gtype}", threads, tokens, ours, theirs, kind, **extra)
    row |= {"baton_format": fmt, "llamacpp_format": gtype}
    target = TARGETS.get("prefill" if kind == "prefill" else extra.get("batch"))
    if target is not None:
        row |= {"target": target, "met": row["ratio"] >= target}
    return row


def _alternate_many(repeats: int, sides: dict) -> dict[str, list[dict]]:
    """Each side's runs, the sides taking turns `repeats` times."""
    runs = {k: [] for k in sides}
    for _ in range(repeats):
        for k, fn in sides.items():
            runs[k].append(fn())
    return runs


def _say(row: dict) -> dict:
    print(f"[bench engine] {row}", file=sys.stderr, flush=True)
    return row


def _bits_config(fmt: str, sz) -> dict:
    """One engine for every workload of `sz`: the largest batch, blocks for the most any
    workload holds at once (prefix reuse off)."""
    batch = max(sz["decode"])
    need = [(1, sz["prefill"] + 2), *((b, p + s + 2) for b, (p, s) in sz["decode"].items())]
    blocks = max(b * (-(-n // 16) + 1) for b, n in need)
    return {"model": model_section(fmt),
            "cache": {"enable_prefix_reuse": False, "num_blocks": blocks + 16,
                      "num_state_slots": batch + 1},
            "worker": {"max_num_seqs": batch, "max_batch_tokens": 2048,
                       "prefill_chunk_size": 2048, "max_model_len": max(n for _, n in need) + 1}}


def _bits_engine(path, fmt: str, sz):
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine

    return build_engine(BatonConfig.from_dict(_bits_config(fmt, sz)), str(path))


RSS_STEPS = 4
"""Decode steps of the batch of 32 (the largest) in the peak-RSS runs."""


def _bits_rss(family, path, py, ggufs, vocab, sz, n_ctx) -> list[dict]:
    """Peak RSS of each engine in a fresh process doing the same work (1 thread): Baton in a
    subprocess of its own (`python -m bench.engine_peer rss`), llama.cpp in a fresh worker."""
    import json
    import subprocess

    batch = max(sz["decode"])
    prompt = prompts(1, sz["prefill"], vocab, seed=7)[0]
    reqs = prompts(batch, sz["decode"][batch][0], vocab, seed=batch)
    ours = {}
    for fmt in dict.fromkeys(f for f, _ in PAIRS):
        cmd = [sys.executable, "-m", "bench.engine_peer", "rss", str(path), fmt,
               json.dumps({k: sz[k] for k in ("prefill", "decode")})]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=peer.HERE.parent)
        if r.returncode:
            raise RuntimeError(f"the Baton RSS probe of {fmt} failed: "
                               f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")
        ours[fmt] = json.loads(r.stdout.strip().splitlines()[-1])
    theirs = {}
    for g, f in ggufs.items():
        w = peer.Worker(py, f, 1, batch, n_ctx + 256)
        try:
            w.call("prefill", prompt=prompt)
            w.call("decode", prompts=reqs, steps=RSS_STEPS)
            theirs[g] = {"peak_rss_kb": w.peak_rss_kb(), "file_bytes": f.stat().st_size}
        finally:
            w.close()
    return [_say(rss_row(family, fmt, g, ours[fmt], theirs[g])) for fmt, g in PAIRS]


def rss_row(family: str, fmt: str, gtype: str, ours: dict, theirs: dict) -> dict:
    """Peak RSS of Baton's `fmt` process and llama.cpp's `gtype` one (KiB in, MiB out)."""
    b, lc = ours["peak_rss_kb"], theirs["peak_rss_kb"]
    return {"benchmark": "engine", "peer": "llamacpp", "family": family,
            "label": f"{family}-rss-{fmt}-vs-{gtype}", "work": "rss", "threads": 1,
            "baton_format": fmt, "llamacpp_format": gtype,
            "baton_peak_rss_mib": round(b / 1024, 1), "llamacpp_peak_rss_mib": round(lc / 1024, 1),
            "rss_ratio": round(b / lc, 3), "target": RSS_TARGET, "met": b / lc <= RSS_TARGET,
            "baton_weight_mb": round(ours["weight_bytes"] / 1e6, 1),
            "llamacpp_gguf_mb": round(theirs["file_bytes"] / 1e6, 1)}


def rss_probe(path: str, fmt: str, sizes_json: str) -> dict:
    """In a process of its own: build the equal-bits engine for `fmt`, prefill the 2k prompt,
    decode the largest batch RSS_STEPS steps; the process's peak RSS and weight bytes."""
    import json

    sz = json.loads(sizes_json)
    sz["decode"] = {int(b): tuple(v) for b, v in sz["decode"].items()}
    torch.set_num_threads(1)
    eng = _bits_engine(path, fmt, sz)
    vocab = _vocab(Path(path))
    batch = max(sz["decode"])
    _baton_prefill(eng, prompts(1, sz["prefill"], vocab, seed=7)[0])
    _baton_decode(eng, prompts(batch, sz["decode"][batch][0], vocab, seed=batch), RSS_STEPS)
    return {"peak_rss_kb": peer.peak_rss_kb(os.getpid()), "weight_bytes": eng.weights.bytes}


def _bits_quality(family, path, py, flags, sz, fp8: Path | None = None) -> list[dict]:
    """KL from Baton's float32, top-1 agreement and perplexity on the held-out windows, for
    Baton's float32 / int8 / int4 / bf16 / `fp8` checkpoint and llama.cpp's f32 and every
    GGUF type of `PAIRS`."""
    wins, refs = _reference(path, *sz["quality"])
    tallies = _baton_tallies(path, wins, refs, fp8)
    tallies |= _llamacpp_tallies(path, py, flags, max(sz["threads"]), wins, refs)
    return [_say(r) for r in quality_rows(family, len(wins), {k: t.metrics()
                                                              for k, t in tallies.items()})]


def _reference(path, seq: int, windows: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The held-out windows and Baton float32's log-probs over each."""
    from bench import quality

    wins, _ = quality._windows(path, seq, windows)
    ref = quality._engine(path, {})
    return wins, [quality._log_probs(ref, w) for w in wins]


def _baton_tallies(path, wins, refs, fp8: Path | None = None) -> dict:
    from bench import quality

    variants = {f: (path, {"model": model_section(f)})
                for f in dict.fromkeys([*(f for f, _ in PAIRS), *QUALITY_ONLY])}
    variants["bf16"] = (path, {"model": {"weight_dtype": "bfloat16"}})
    if fp8 is not None:
        variants["fp8"] = (fp8, {})
    tallies = {("baton", "float32"): quality.Tally()}
    for w, lp_ref in zip(wins, refs, strict=True):  # the reference itself: KL 0, perplexity
        tallies[("baton", "float32")].add(lp_ref, torch.tensor(w[1:]), lp_ref)
    for fmt, (where, sections) in variants.items():
        eng, t = quality._engine(where, sections), quality.Tally()
        for w, lp_ref in zip(wins, refs, strict=True):
            t.add(quality._log_probs(eng, w), torch.tensor(w[1:]), lp_ref)
        tallies[("baton", fmt)] = t
        del eng
    return tallies


def _llamacpp_tallies(path, py, flags, threads: int, wins, refs) -> dict:
    """llama.cpp's f32 and `PAIRS` GGUFs through its own logits of every position."""
    import tempfile

    import numpy as np

    from bench import quality

    tallies = {}
    seq = max(len(w) for w in wins)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.f32"
        for g in ["f32", *sorted({g for _, g in PAIRS})]:
            worker = peer.Worker(py, peer.gguf(path, g, flags, py), threads, 1, seq + 64)
            t = quality.Tally()
            try:
                for w, lp_ref in zip(wins, refs, strict=True):
                    shape = worker.call("logits", prompt=w[:-1], out=str(out))
                    lg = torch.from_numpy(np.fromfile(out, dtype=np.float32))
                    lp = torch.log_softmax(lg.reshape(shape["n"], shape["vocab"]), dim=-1)
                    t.add(lp, torch.tensor(w[1:]), lp_ref)
            finally:
                worker.close()
            tallies[("llamacpp", g)] = t
    return tallies


def quality_rows(family: str, windows: int, metrics: dict[tuple[str, str], dict]) -> list[dict]:
    """One row per (engine, format) of `metrics` (Tally.metrics), then one per `PAIRS` entry
    with Baton's KL over llama.cpp's (`kl_ratio`: at most 1 meets the issue's target)."""
    rows = [{"benchmark": "engine", "peer": "llamacpp", "family": family,
             "label": f"{family}-quality-{engine}-{fmt}", "work": "quality", "engine": engine,
             "format": fmt, "windows": windows, **{k: _round(v) for k, v in m.items()}}
            for (engine, fmt), m in metrics.items()]
    for fmt, g in PAIRS + (("fp8", "bf16"),):
        b = metrics.get(("baton", fmt))
        lc = metrics.get(("baton", g) if fmt == "fp8" else ("llamacpp", g))
        if b is None or lc is None:
            continue
        them = "bf16" if fmt == "fp8" else "llamacpp"  # fp8: against Baton's own bf16
        row = {"benchmark": "engine", "peer": "baton-bf16" if fmt == "fp8" else "llamacpp",
               "family": family, "label": f"{family}-quality-{fmt}-vs-{g}", "work": "quality",
               "baton_format": fmt, f"{them}_format": g,
               "baton_mean_kl": _round(b["mean_kl"]), f"{them}_mean_kl": _round(lc["mean_kl"]),
               "kl_ratio": round(b["mean_kl"] / lc["mean_kl"], 3) if lc["mean_kl"] else None,
               "baton_top1": _round(b["top1_agreement"]),
               f"{them}_top1": _round(lc["top1_agreement"]),
               "baton_perplexity": _round(b["perplexity"]),
               f"{them}_perplexity": _round(lc["perplexity"])}
        if them == "llamacpp":  # the quality target: Baton's KL no worse
            row["met"] = b["mean_kl"] <= lc["mean_kl"]
        rows.append(row)
    return rows


def _round(x):
    return float(f"{x:.5g}") if isinstance(x, float) else x


if __name__ == "__main__":
    if sys.argv[1:2] == ["rss"]:
        import json

        print(json.dumps(rss_probe(*sys.argv[2:5])), flush=True)
