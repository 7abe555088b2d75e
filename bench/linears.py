"""`python -m bench.linears`: the 57 linear layers of the bench 100m NemotronH, one decode step's
worth, on each CPU path side by side in one run, with this machine's read bandwidth.

Paths: `F.linear` (MKL sgemm: the reference path), the previous fast path (MKL on a transposed
copy for one row of a wide layer, oneDNN on a reordered weight otherwise), Baton's kernel
(`baton/model/layers/cpu_kernels`) on float32, float16 and bfloat16 weights, and the chunked
upcast the half path used before it. Rows are the batch (one token a sequence); each pass
calls every layer once in model order, so its weights (366 MB in float32) come from memory,
as in decode. Paths alternate pass by pass; medians of wall and CPU time (this process, all
threads) per pass, and the floor: each layer's best time in any pass, summed (on a shared
machine the other load inflates the medians, most of all at 2 threads, where a parallel region
waits for its slowest thread). Read bandwidth: `sum()` of a 512 MiB tensor at the same
threads, median and floor the same way.
Prints one JSON line a (threads, rows).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
import torch.nn.functional as F

from baton.model.layers import cpu_kernels
from baton.model.layers.linear import HALF_CHUNK, PACK_HINT


def _weights() -> list[torch.Tensor]:
    from baton.model.loader import load_model
    from bench.common import checkpoint

    model = load_model(checkpoint("100m", "nemotron_h"))
    return [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _previous_fast(w):
    """One layer on the previous fast path: MKL on a transposed copy for one row of a wide
    layer, oneDNN on its reordered weight otherwise."""
    wt, packed = w.t().contiguous(), torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT)

    def run(x):
        if x.shape[0] == 1 and w.shape[0] >= w.shape[1]:
            return torch.mm(x, wt)
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return run


def _chunked(w):
    """One layer on the previous half path: upcast 256 weight rows at a time, then mm."""
    def run(x):
        n, k = w.shape
        out, buf = x.new_empty(n, x.shape[0]), x.new_empty(min(HALF_CHUNK, n), k)
        for i in range(0, n, HALF_CHUNK):
            c = buf[:min(HALF_CHUNK, n - i)]
            c.copy_(w[i:i + c.shape[0]])
            torch.mm(c, x.t(), out=out[i:i + c.shape[0]])
    return run


def _paths(ws) -> dict[str, list]:
    """Path name -> one callable a layer, taking that layer's input."""
    kernel = cpu_kernels.gemv()
    paths = {"mkl": [functools.partial(lambda w, x: F.linear(x, w), w) for w in ws],
             "prev_fast": [_previous_fast(w) for w in ws]}
    if kernel is not None:
        paths["kernel"] = [functools.partial(lambda w, x: kernel.linear(x, w), w) for w in ws]
    for dt, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
        half = [w.to(dt) for w in ws]
        paths[f"prev_{name}"] = [_chunked(w) for w in half]
        if kernel is not None:
            paths[f"kernel_{name}"] = [functools.partial(lambda w, x: kernel.linear(x, w), w)
                                       for w in half]
    return paths


def _timings(paths: dict[str, list], xs: list, reps: int) -> dict:
    """Per path: median pass (wall, CPU) and the floor, the sum over layers of each layer's
    best time in any pass (the other load rarely spares a whole pass, often one layer)."""
    wall, cpu = {k: [] for k in paths}, {k: [] for k in paths}
    layer = {k: [[] for _ in xs] for k in paths}
    for _ in range(reps + 1):
        for k, ops in paths.items():
            c, t = time.process_time(), time.perf_counter()
            for i, (op, x) in enumerate(zip(ops, xs, strict=True)):
                t0 = time.perf_counter()
                op(x)
                layer[k][i].append(time.perf_counter() - t0)
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    ms = 1e3
    return {k: (statistics.median(wall[k][1:]) * ms, statistics.median(cpu[k][1:]) * ms,
                sum(min(ts[1:]) for ts in layer[k]) * ms) for k in paths}


def _read_gbs(reps: int) -> tuple[float, float]:
    """Read bandwidth, median and floor (as `_timings`): `sum()` of a 512 MiB tensor, timed in
    64 slices of 8 MiB (each read cold: the other slices pass through the 32 MiB L3 between)."""
    big = torch.randn(64, 2 << 20)
    ts = [[] for _ in big]
    for _ in range(reps + 1):
        for i, part in enumerate(big):
            t = time.perf_counter()
            part.sum()
            ts[i].append(time.perf_counter() - t)
    gb = big.numel() * 4 / 1e9
    passes = [sum(col) for col in zip(*(t[1:] for t in ts), strict=True)]
    return gb / statistics.median(passes), gb / sum(min(t[1:]) for t in ts)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    ws = _weights()
    paths = _paths(ws)
    mb = sum(w.numel() for w in ws) * 4 / 1e6
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        gbs, best_gbs = _read_gbs(args.reps)
        for rows in map(int, args.rows.split(",")):
            xs = [torch.randn(rows, w.shape[1]) for w in ws]
            res = _timings(paths, xs, args.reps)
            row = {"threads": threads, "rows": rows, "read_gbs": round(gbs, 1),
                   "floor_read_gbs": round(best_gbs, 1),
                   "f32_at_floor_read_ms": round(mb / best_gbs, 1),
                   **{f"{k}_ms": round(v[0], 2) for k, v in res.items()},
                   **{f"{k}_cpu_ms": round(v[1], 2) for k, v in res.items()},
                   **{f"{k}_floor_ms": round(v[2], 2) for k, v in res.items()}}
            print(json.dumps(row), flush=True)

if __name__ == "__main__":
    main()
