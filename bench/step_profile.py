"""Where a decode step's time goes: an engine step at batch 1, 8, 32 on the fast path
(`BATON_DECODE_PATH=fast`) next to the time of its linear layers alone (the same modules on
inputs of the same shape), for the bench 100m NemotronH and Qwen3.5 (and the peer bench's
`nemotron_h_moe`, `qwen3_5_moe`; their "linears" leave out the routed experts).

    PYTHONPATH=$PWD python -m bench.step_profile [--family nemotron_h] [--batch 1 8 32]
        [--threads 1] [--steps 12] [--weight-dtype float16] [--profile]

"step / linears" is the figure of issue 24 (target <= 1.15 at batch 32). Steps and linear
passes alternate, and each figure is the median over its passes, so load from other processes
on a shared machine hits both alike. Times are wall-clock and CPU time of this process.
`--profile` adds a torch.profiler table of one batch's steps (ops by self CPU time) and a
cProfile of the Python around them (by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

from baton.model.layers import fast_decode, linear, step_kernels
from bench.common import checkpoint, decode_engine, prompts
from bench.roofline import _linears

PROMPTS = {1: 512, 8: 512, 32: 128}
"""Prompt tokens per request at each batch size (what `bench engine --peer llamacpp` decodes
after); other batch sizes get 128."""


def _checkpoint(family: str):
    """The bench model of `family`: the peer bench's (`nemotron_h_moe` is `bench moe`'s)."""
    from bench.engine_peer import FAMILIES, _checkpoint

    return _checkpoint(family, FAMILIES[family][0]) if family in FAMILIES else checkpoint(
        "100m", family)


def build(family: str, batch: int, steps: int, prompt: int | None = None,
          weight_dtype: str = "float32"):
    """A fast-path engine with `batch` requests that have finished their prompts."""
    from baton.engine.request import Request, SamplingParams

    path = _checkpoint(family)
    prompt = prompt or PROMPTS.get(batch, 128)
    total = prompt + 2 * steps + 32
    eng = decode_engine(path, batch, total, weight_dtype=weight_dtype)
    sp = SamplingParams(max_tokens=2 * steps + 24, ignore_eos=True)
    for i, p in enumerate(prompts(batch, prompt, eng.model.config.vocab_size, seed=batch)):
        eng.add_request(Request(f"s{i}", p, sp))
    while any(r.phase.name != "DECODE" for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    return eng


def linear_pass(model, xs):
    with linear.decode_scope():
        for m, x in zip(_linears(model), xs, strict=True):
            m(x)


def _timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def _kernels(on: bool) -> None:
    """The step kernels on, or off (the fast path's torch.compile'd steps)."""
    built = step_kernels._cache.setdefault("built", step_kernels.kernels())
    step_kernels._cache["step"] = built if on else None


_fused = linear.fused_linears


def _fused_projections(on: bool) -> None:
    """A layer's input projections in one kernel call (`linear.fused_linears`), or one by one."""
    linear.fused_linears = _fused if on else (lambda x, *layers: None)


_applies = fast_decode.applies


def _direct_layers(on: bool) -> None:
    """The layers' kernels called directly (`fast_decode`), or through the modules."""
    fast_decode.applies = _applies if on else (lambda h, pools: False)


VARIANTS = {"kernels": _kernels, "fused": _fused_projections, "direct": _direct_layers}
"""What `--compare` switches off and on between alternate steps (before / after a change)."""


def measure(eng, batch: int, steps: int, compare: str | None = None) -> dict:
    """Median step and linear-pass times; with `compare`, steps alternate between that
    variant off (`before_*`) and on, so both see the same load and the same batch."""
    model = eng.model
    xs = [torch.randn(batch, m.in_features) for m in _linears(model)]
    flips = (False, True) if compare else (None,)
    times: dict = {f: [] for f in flips}
    lin = []
    with torch.inference_mode():
        for _ in range(steps + 3):
            for f in flips:
                if compare:
                    VARIANTS[compare](f)
                times[f].append(_timed(eng.step))
            lin.append(_timed(lambda: linear_pass(model, xs)))
    for f in flips:
        times[f] = times[f][3:]  # the first are warm-up: compiled steps, packed weights
    lw, lc = (statistics.median(v[i] for v in lin[3:]) for i in (0, 1))
    row = {"batch": batch, "linear_ms": round(lw * 1e3, 2), "linear_cpu_ms": round(lc * 1e3, 2)}
    for f in flips:
        sw, sc = (statistics.median(v[i] for v in times[f]) for i in (0, 1))
        pre = "before_" if f is False else ""
        row.update({f"{pre}step_ms": round(sw * 1e3, 2),
                    f"{pre}overhead_ms": round((sw - lw) * 1e3, 2),
                    f"{pre}step_over_linear": round(sw / lw, 3),
                    f"{pre}step_cpu_ms": round(sc * 1e3, 2),
                    f"{pre}cpu_step_over_linear": round(sc / lc, 3)})
    return row


def profile(eng, steps: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with torch.inference_mode():
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            eng.step()
        pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", nargs="+", default=["nemotron_h", "qwen3_5"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompt", type=int, help="prompt tokens (default: PROMPTS)")
    ap.add_argument("--path", default="fast", choices=["fast", "reference"])
    ap.add_argument("--weight-dtype", default="float32",
                    choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compare", choices=sorted(VARIANTS),
                    help="alternate steps with this change off and on")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    linear.set_decode_path(args.path)
    for family in args.family:
        for b in args.batch:
            eng = build(family, b, args.steps, args.prompt, args.weight_dtype)
            row = {"family": family, "path": args.path, "threads": args.threads,
                   "weight_dtype": args.weight_dtype,
                   **measure(eng, b, args.steps, args.compare)}
            print(json.dumps(row), flush=True)
            if args.profile:
                profile(eng, 4)
            del eng
    sys.stdout.flush()


if __name__ == "__main__":
    main()
