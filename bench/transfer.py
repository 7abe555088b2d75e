"""Transfer benchmark: prefill -> decode handoffs of 1 MiB .. 512 MiB between two processes.

    python -m bench.transfer --json [--backend nixl|ucx] [--sizes-mib 1 4 16 64 256 512]

Layout (bf16, 16-token blocks): 24 layers `M*-` x 8, so each handoff carries 8 attention
layers of KV (16 KiB per layer per block, 128 KiB per block over all layers) and one live
state per Mamba layer (8 x 35.75 KiB). Block tables are fragmented into runs of
`--run-blocks` blocks in shuffled order on both sides, as a cache manager leaves them.

Per size: median seconds from `send()` to the delivered event, GB/s, descriptors before
and after coalescing, a single-threaded memcpy of the same bytes in the same run (prefill
process) and the ratio. `fixed_cost_us`: a one-block handoff's median time minus its bytes
at the largest size's rate. `ucx_transports`: what UCX chose (UCX_PROTO_INFO), per
operation. `bit_exact`: blake2b of the destination ranges equals the source's, checked
after the timed runs.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

import numpy as np

from bench.harness.loopback import StageProc
from bench.harness.testbed import tiny_model

MODEL = tiny_model("M*-" * 8, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=64, mamba_num_heads=16, mamba_head_dim=32, ssm_state_size=32,
                   n_groups=2)
KV_BYTES_PER_BLOCK = 8 * 2 * 16 * 4 * 64 * 2
STATE_BYTES = 8 * (16 * 32 * 32 * 2 + (16 * 32 + 2 * 2 * 32) * 3 * 2)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.transfer", description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["nixl", "ucx"], default="nixl")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256, 512])
    p.add_argument("--reps", type=int, default=10, help="timed handoffs per size (min 3)")
    p.add_argument("--run-blocks", type=int, default=16, help="contiguous blocks per run")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p


def block_table(n: int, run: int, seed: int, offset: int = 0) -> list[int]:
    """n block ids made of `run`-long contiguous runs placed in shuffled order."""
    runs = -(-n // run)
    order = np.random.default_rng(seed).permutation(runs)
    ids = (offset + order[:, None] * run + np.arange(run)[None, :]).reshape(-1)
    return ids[:n].tolist()


def run(args) -> list[dict]:
    # `baton bench transfer` passes its own namespace: fill what it lacks with our defaults,
    # and measure both backends
    defaults = vars(parser().parse_args([]))
    if getattr(args, "quick", False):
        defaults.update(sizes_mib=[1, 16, 64], reps=3)
    backends = [args.backend] if hasattr(args, "backend") else ["nixl", "ucx"]
    args = argparse.Namespace(**{**defaults, **{k: v for k, v in vars(args).items()
                                                 if k in defaults and k != "json"}})
    rows = []
    for backend in backends:
        args.backend = backend
        rows += _run_backend(args)
    return rows


def _run_backend(args) -> list[dict]:
    sizes = [int(s * 2**20) for s in args.sizes_mib]
    nblocks = [max(1, round((s - STATE_BYTES) / KV_BYTES_PER_BLOCK)) for s in sizes]
    pool = -(-max(nblocks) // args.run_blocks) * args.run_blocks + args.run_blocks
    common = dict(backend=args.backend, model=MODEL, layers=list(range(24)), num_blocks=pool,
                  tokens_per_block=16, num_slots=2, dtype="bfloat16")
    dec, pre = StageProc(), StageProc()
    try:
        ep = _ok(dec.call("setup", role="decode", seed=-1, **common, timeout=300))["endpoint"]
        _ok(pre.call("setup", role="prefill", seed=3, env={"UCX_PROTO_INFO": "y"}, **common,
                     timeout=300))
        small = _handoff(dec, pre, ep, 1, args, "fixed", reps=max(args.reps, 20))
        rows = [_handoff(dec, pre, ep, n, args, f"s{i}", reps=_reps(args.reps, s))
                for i, (n, s) in enumerate(zip(nblocks, sizes, strict=True))]
    finally:
        dec.stop()
        pre.stop()
    top = rows[-1]["gbps"] * 1e9
    fixed_us = max(0.0, (small["seconds"] - small["bytes"] / top) * 1e6)
    for r in rows:
        r["fixed_cost_us"] = round(fixed_us, 1)
        r["ucx_transports"] = small["ucx_transports"]
    return rows


def _reps(reps: int, size: int) -> int:
    return max(3, reps if size <= 64 * 2**20 else reps // 3)


def _handoff(dec, pre, ep, n: int, args, tag: str, reps: int) -> dict:
    src = block_table(n, args.run_blocks, seed=n)
    dst = block_table(n, args.run_blocks, seed=n + 1, offset=0)
    rids = [f"{tag}-{i}" for i in range(reps + 1)]  # the first one is warm-up
    _ok(dec.call("batch", calls=[["expect", dict(rid=r, blocks=dst, slot=1)] for r in rids]))
    res = _ok(pre.call("bench_send", endpoint=ep, src_blocks=src, src_slot=0, dst_blocks=dst,
                       dst_slot=1, rids=rids, capture=tag == "fixed", timeout=600))
    evs = _ok(dec.call("wait", rids=rids, timeout=60))["events"]
    delivered = len(evs) == len(rids) and all(ok for _, ok, _ in evs)
    same = (_ok(pre.call("digest", ranges=res["src_ranges"]))["digest"]
            == _ok(dec.call("digest", ranges=res["dst_ranges"]))["digest"])
    seconds = statistics.median(res["times"][1:])
    mem = statistics.median(_ok(pre.call("memcpy", nbytes=res["bytes"], reps=reps))["times"])
    gbps, mem_gbps = res["bytes"] / seconds / 1e9, res["bytes"] / mem / 1e9
    return {"bench": "transfer", "backend": args.backend, "bytes": res["bytes"], "blocks": n,
            "seconds": seconds, "gbps": round(gbps, 3), "memcpy_gbps": round(mem_gbps, 3),
            "ratio_to_memcpy": round(gbps / mem_gbps, 3), "descriptors": res["descriptors"],
            "descriptors_coalesced": res["descriptors_coalesced"], "reps": reps,
            "bit_exact": bool(same and delivered), "ucx_transports": _transports(res["proto"])}


def _transports(proto: str) -> dict[str, list[str]]:
    """{"put": [...], "am": [...]}: transport/device per UCX operation, from UCX_PROTO_INFO."""
    out, op = {}, None
    for line in proto.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1 and " by " in cells[0]:
            op = "put" if "ucp_put" in cells[0] else "am" if "am_send" in cells[0] else \
                re.sub(r"\s+from host memory.*", "", cells[0])
        elif len(cells) == 3 and op and "/" in cells[2] and cells[0] != "Range":
            out.setdefault(op, set()).add(cells[2].split()[0])
    return {k: sorted(v) for k, v in out.items()}


def _ok(reply: dict) -> dict:
    if not reply["ok"]:
        raise RuntimeError(reply["error"] + "\n" + reply.get("trace", ""))
    return reply


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows = run(args)
    for r in rows:
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['bytes'] / 2**20:8.1f} MiB  {r['gbps']:7.2f} GB/s  "
                  f"memcpy {r['memcpy_gbps']:6.2f} GB/s  x{r['ratio_to_memcpy']:.2f}  "
                  f"desc {r['descriptors']}->{r['descriptors_coalesced']}  "
                  f"fixed {r['fixed_cost_us']} us  exact={r['bit_exact']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
