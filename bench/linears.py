"""`python -m bench.linears`: the 57 linear layers of the bench 100m NemotronH, one decode step's
worth, on each CPU path side by side in one run, with this machine's read bandwidth.

Paths: `F.linear` (MKL sgemm: the reference path), the previous fast path (MKL on a transposed
copy for one row of a wide layer, oneDNN on a reordered weight otherwise), Baton's kernel
(`baton/model/layers/cpu_kernels`) on float32, float16 and bfloat16 weights, and the chunked
upcast the half path used before it. Rows are the batch (one token a sequence); each pass
calls every layer once in model order, so its weights (366 MB in float32) come from memory,
as in decode. Paths alternate pass by pass; medians of wall and CPU time (this process, all
threads) per pass. Read bandwidth: the median `sum()` of a 512 MiB tensor at the same threads.
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


def _previous_fast(ws):
    wt = [w.t().contiguous() for w in ws]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT) for w in ws]

    def run(xs):
        for w, t, p, x in zip(ws, wt, packed, xs, strict=True):
            if x.shape[0] == 1 and w.shape[0] >= w.shape[1]:
                torch.mm(x, t)
            else:
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    return run


def _chunked(ws):
    def run(xs):
        for w, x in zip(ws, xs, strict=True):
            n, k = w.shape
            out, buf = x.new_empty(n, x.shape[0]), x.new_empty(min(HALF_CHUNK, n), k)
            for i in range(0, n, HALF_CHUNK):
                c = buf[:min(HALF_CHUNK, n - i)]
                c.copy_(w[i:i + c.shape[0]])
                torch.mm(c, x.t(), out=out[i:i + c.shape[0]])
    return run


def _each(op, ws):
    """A pass calling `op(x, w)` for every layer."""
    def run(xs):
        for w, x in zip(ws, xs, strict=True):
            op(x, w)
    return run


def _paths(ws) -> dict:
    paths = {"mkl": _each(F.linear, ws), "prev_fast": _previous_fast(ws)}
    kernel = cpu_kernels.gemv()
    if kernel is not None:
        paths["kernel"] = _each(kernel.linear, ws)
    for dt, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
        half = [w.to(dt) for w in ws]
        paths[f"prev_{name}"] = _chunked(half)
        if kernel is not None:
            paths[f"kernel_{name}"] = _each(kernel.linear, half)
    return paths


def _medians(fns: dict, reps: int) -> dict:
    wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(reps):
        for k, f in fns.items():
            c, t = time.process_time(), time.perf_counter()
            f()
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    return {k: (statistics.median(wall[k]) * 1e3, statistics.median(cpu[k]) * 1e3) for k in fns}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    ws = _weights()
    paths, big = _paths(ws), torch.randn(128 << 20)
    mb = sum(w.numel() for w in ws) * 4 / 1e6
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        bw = _medians({"sum": big.sum}, args.reps)["sum"]
        gbs = big.numel() * 4 / 1e9 / (bw[0] / 1e3)
        for rows in map(int, args.rows.split(",")):
            xs = [torch.randn(rows, w.shape[1]) for w in ws]
            res = _medians({k: functools.partial(f, xs) for k, f in paths.items()}, args.reps)
            row = {"threads": threads, "rows": rows, "read_gbs": round(gbs, 1),
                   "f32_at_bandwidth_ms": round(mb / gbs, 1),
                   **{f"{k}_ms": round(v[0], 2) for k, v in res.items()},
                   **{f"{k}_cpu_ms": round(v[1], 2) for k, v in res.items()}}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
