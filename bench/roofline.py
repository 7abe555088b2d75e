"""Roofline figures of `bench engine --peer llamacpp`, measured in the same run as the rows:

- prefill: the model's FLOPs for the prompt (every linear layer per token, a MoE block's
  top-k routed experts per token, attention's scores and values, the lm_head for the last
  token; the scan's small terms left out) per CPU second of a prefill, as a fraction of this
  machine's matmul peak (the best of a few fp32 [T, hidden] x [hidden, 4 * hidden] matmuls,
  MKL's or oneDNN's), the peak measured right after each prefill run and the figure the
  median of the runs' fractions (`engine_peer._prefill_row`); the fraction over one peak
  measured apart, after the rows, is still given (`separate_peak_fraction`);
- decode: a step over the model's linear layers alone at that batch size (each module called
  once on a random [batch, in] input, and each MoE block's routed experts for batch tokens of
  top-k experts each), measured side by side: engine steps of the batch and linear passes
  alternate (`side_by_side`), and the figure is the median of each step over the pass after
  it. Both see the same load and the same cache state: timed apart, the pass ran back to back
  in a loop of its own after the rows (part of the weights still in L3, another moment's
  neighbours), and on the Zen 3 a Qwen3.5 batch-32 step read 1.21x its linears where the
  same step and pass alternating read 1.04x. That older figure is still given
  (`run_step_over_linear`: the row's step over a separate median pass). Next to it the floor
  the memory sets: a step must also read and write every live recurrent state once and read
  its keys and values (`step_stream_bytes`); that many bytes streamed cold on this machine, in
  the same run (`stream_seconds`), over the linears gives `floor_over_linear`, the least a
  step over its linears can read here with everything else free.

All in CPU seconds of this process (every thread), not wall time: on a shared machine the
wall clock mostly measures the other load (the rows' `*_wait_frac`), CPU time the work. At 2
threads the fractions are per core: FLOP/s per CPU second over the per-core peak.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch import nn

from baton.model.layers.linear import decode_scope


def _passes(fn, reps: int) -> list[float]:
    """CPU seconds of `reps` passes of fn after one unmeasured, sorted."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return sorted(out)


def _best(fn, reps: int = 5) -> float:
    return _passes(fn, reps)[0]


def matmul_peak_gflops(m: int, k: int, n: int) -> float:
    """The best of MKL's sgemm and oneDNN's matmul (the fast path's prefill linears), which
    is 1.2-1.4x faster on this AMD machine: the peak is what the machine can do."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    best = _best(lambda: torch.mm(a, b))
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        w = b.t().contiguous()
        best = min(best, _best(
            lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")))
    return 2 * m * k * n / best / 1e9


def _linears(model) -> list[nn.Module]:
    """Every linear layer of the model, lm_head included (decode runs it for every row)."""
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _moe_blocks(model) -> list[tuple[int, list[torch.Tensor]]]:
    """(top-k, stacked expert projections [E, ...] each) of every MoE block of the model: the
    routed experts, which are not `nn.Linear`s, so `_linears` leaves them out."""
    blocks = []
    for m in model.modules():
        experts = getattr(m, "experts", None)
        names = getattr(experts, "stacked", ())
        if names:
            k = getattr(m, "top_k", None) or m.gate.cfg.num_experts_per_tok
            blocks.append((k, [getattr(experts, n) for n in names]))
    return blocks


def _routed_expert_flops(model) -> int:
    """FLOPs a token spends in the routed experts it is sent to: every MoE block's top-k
    experts' stacked projections."""
    return sum(2 * k * sum(t[0].numel() for t in stacks)  # one expert's weights, k of them
               for k, stacks in _moe_blocks(model))


def prefill_flops(model, T: int) -> float:
    cfg = model.config
    lin = sum(2 * m.in_features * m.out_features for m in _linears(model)
              if m is not model.lm_head) + _routed_expert_flops(model)
    attn = len(cfg.attention_layers) * 2 * 2 * cfg.num_attention_heads * cfg.head_dim
    return lin * T + attn * T * (T + 1) / 2 + 2 * cfg.hidden_size * cfg.vocab_size


def _expert_runs(model, batch: int) -> list:
    """Per MoE block, its routed experts' up and down projections for `batch` tokens, top-k
    distinct experts each (drawn at random, seeded: about as many experts active as a real
    router's spread gives), as the decode kernel's grouped
    matmuls (`gemv.grouped_linear`, what a decode step runs; no routing, activation or sum):
    the matmuls `_linears` does not hold. None where the kernel is not built."""
    from baton.model.layers import cpu_kernels

    g = cpu_kernels.gemv()
    blocks = _moe_blocks(model)
    if blocks and g is None:
        return None
    runs = []
    for k, (up, down) in blocks:
        choice = _expert_choice(k, up.shape[0], batch)
        order = torch.argsort(choice, stable=True)
        counts = torch.bincount(choice, minlength=up.shape[0])
        x, z = torch.randn(batch, up.shape[-1]), torch.randn(batch * k, down.shape[-1])
        tokens = order // k
        runs.append(lambda x=x, z=z, up=up, down=down, c=counts, t=tokens: (
            g.grouped_linear(x, up, c, t), g.grouped_linear(z, down, c)))
    return runs


def _expert_choice(k: int, experts: int, batch: int) -> torch.Tensor:
    """The routed experts of `batch` tokens of a MoE block as `_expert_runs` draws them:
    [batch * k], each token's k distinct (seeded by the batch size)."""
    gen = torch.Generator().manual_seed(batch)
    return torch.cat([torch.randperm(experts, generator=gen)[:k] for _ in range(batch)])


def weight_bytes(model, batch: int) -> int:
    """The weight bytes a decode step of `batch` rows reads, as stored: every linear layer's
    weight once and, per MoE block, each routed expert `_expert_runs` draws for the batch
    once (every stacked projection of it)."""
    total = sum(m.weight.numel() * m.weight.element_size() for m in _linears(model))
    for k, stacks in _moe_blocks(model):
        used = torch.unique(_expert_choice(k, stacks[0].shape[0], batch))
        total += len(used) * sum(t[0].numel() * t.element_size() for t in stacks)
    return total


def linear_pass(model, batch: int):
    """A decode step's matmuls alone at `batch` rows, as a function: every linear layer once,
    and each MoE block's routed experts (`_expert_runs`; left out where the kernel is not
    built), with the kernels the decode step itself uses."""
    mods = _linears(model)
    xs = [torch.randn(batch, m.in_features) for m in mods]
    experts = _expert_runs(model, batch) or []

    @torch.inference_mode()
    def once():
        with decode_scope():
            for m, x in zip(mods, xs, strict=True):
                m(x)
            for run in experts:
                run()
    return once


def linear_step_seconds(model, batch: int, reps: int = 9) -> tuple[float, float]:
    """`linear_pass` timed alone, back to back: (the median pass, the best pass) in CPU
    seconds."""
    times = _passes(linear_pass(model, batch), reps)
    return times[len(times) // 2], times[0]


@torch.inference_mode()
def side_by_side(eng, prompts: list[list[int]], pairs: int = 12, warm: int = 3) -> dict:
    """A decode step of `prompts` (all in decode at once) against the linear pass of its batch
    size and a plain read of as many bytes as its weights (`weight_bytes`: torch's sum over a
    float32 buffer, the memory's rate at these threads), alternating: `warm` + `pairs`
    (step, pass, read) rounds after every prompt has its first token, the first `warm`
    dropped; then the requests are aborted. CPU seconds: the median step, the median pass
    and the median of each step over the pass after it; wall-clock: the weight bytes over the
    median step and the median read (GB/s), and the median of each step over the read after
    it (`step_over_read`: 1.0 is a step that reads its weights as fast as a plain read)."""
    from baton.engine.request import Request, SamplingParams

    sp = SamplingParams(max_tokens=warm + pairs + 2, ignore_eos=True)
    ids = [f"roofline-{i}" for i in range(len(prompts))]
    once = linear_pass(eng.model, len(prompts))
    nbytes = weight_bytes(eng.model, len(prompts))
    buf = torch.ones(max(nbytes // 4, 1))
    steps, passes, step_walls, reads = [], [], [], []
    try:  # the requests aborted however it ends (a failed prefill too)
        for rid, p in zip(ids, prompts, strict=True):
            eng.add_request(Request(rid, p, sp))
        seen: set[str] = set()
        while len(seen) < len(ids):
            seen |= {o.request_id for o in eng.step() if o.new_token_ids}
        for _ in range(warm + pairs):
            w0, t0 = time.perf_counter(), time.process_time()
            out = eng.step()
            steps.append(time.process_time() - t0)
            step_walls.append(time.perf_counter() - w0)
            assert sum(len(o.new_token_ids) for o in out) == len(ids), "a request left the batch"
            t0 = time.process_time()
            once()
            passes.append(time.process_time() - t0)
            w0 = time.perf_counter()
            buf.sum()
            reads.append(time.perf_counter() - w0)
    finally:
        for rid in ids:
            eng.abort(rid)
    steps, passes, step_walls, reads = (v[warm:] for v in (steps, passes, step_walls, reads))
    return {"step_s": statistics.median(steps), "linear_s": statistics.median(passes),
            "ratio": statistics.median(a / b for a, b in zip(steps, passes, strict=True)),
            "weight_mb": nbytes / 1e6,
            "step_gbps": nbytes / statistics.median(step_walls) / 1e9,
            "read_gbps": nbytes / statistics.median(reads) / 1e9,
            "step_over_read": statistics.median(
                a / b for a, b in zip(step_walls, reads, strict=True))}


def step_stream_bytes(config, batch: int, context: float) -> tuple[int, int]:
    """(recurrent state bytes a decode step reads and writes, KV bytes it reads) for `batch`
    sequences of `context` tokens: every state tensor of every state layer (the model's
    declared state spec) and K and V of every attention layer, float32."""
    from baton.model.pools import PoolSpec

    state = PoolSpec.for_model(config, num_blocks=1, tokens_per_block=1,
                               num_slots=1).state_bytes_per_slot()
    kv = len(config.attention_layers) * 2 * config.num_key_value_heads * config.head_dim * 4
    return batch * state, int(batch * context * kv)


_FLUSH_BYTES = 640 << 20
"""Streamed between timed passes so the timed bytes come from memory, as in a step (whose
weights evict them): more than this machine's L3."""


@torch.inference_mode()
def stream_seconds(state_bytes: int, kv_bytes: int, reps: int = 5) -> float:
    """CPU seconds to stream a step's bytes from cold caches at the current thread count:
    `state_bytes` read and written in place (one multiply), `kv_bytes` read (one sum); best
    of `reps`."""
    state = torch.ones(max(state_bytes // 4, 1))
    kv = torch.ones(max(kv_bytes // 4, 1))
    flush = torch.empty(_FLUSH_BYTES // 4)
    out = []
    for i in range(reps + 1):
        flush.fill_(i)
        t0 = time.process_time()
        state.mul_(1.0)
        if kv_bytes:
            kv.sum()
        out.append(time.process_time() - t0)
    return min(out[1:])


def roofline_rows(family: str, model, rows: list[dict], sz: dict) -> list[dict]:
    """The roofline rows of `family` from its measured rows: prefill over the matmul peak, and
    each decode row (with the `side_by_side` figures `engine_peer._decode_row` took) over its
    linears and the memory floor."""
    out = []
    hidden = model.config.hidden_size
    for threads in sz["threads"]:
        torch.set_num_threads(threads)
        # FLOPs per CPU second (`_best` times process_time, every thread's): already per core
        peak = matmul_peak_gflops(sz["prefill"], hidden, 4 * hidden)
        for r in rows:
            if r.get("threads") != threads or r.get("family") != family:
                continue
            if r.get("work") == "prefill":
                cpu_s = r["baton_cpu_ms_per_token"] * sz["prefill"] / 1e3
                got = prefill_flops(model, sz["prefill"]) / cpu_s / 1e9
                sbs = r.get("side_by_side", {})
                out.append(_emit({"label": f"{family}-roofline-prefill-t{threads}",
                                  "matmul_peak_gflops_per_core": sbs.get("peak_gflops"),
                                  "prefill_gflops_per_core": round(got, 1),
                                  "prefill_peak_fraction": sbs.get("fraction"),
                                  "separate_peak_gflops_per_core": round(peak, 1),
                                  "separate_peak_fraction": round(got / peak, 3)}, family,
                                 threads))
            elif r.get("work") == "decode" and "side_by_side" in r:
                b, sbs = r["batch"], r["side_by_side"]
                lin, best = linear_step_seconds(model, b)
                run_step = b * r["baton_cpu_ms_per_token"] / 1e3
                prompt, steps = sz["decode"][b]
                state, kv = step_stream_bytes(model.config, b, prompt + steps / 2)
                stream = stream_seconds(state, kv)
                pair_lin = sbs["linear_s"]
                out.append(_emit({"label": f"{family}-roofline-decode-b{b}-t{threads}",
                                  "batch": b, "step_cpu_ms": round(sbs["step_s"] * 1e3, 2),
                                  "linear_cpu_ms": round(pair_lin * 1e3, 2),
                                  "step_over_linear": round(sbs["ratio"], 3),
                                  "run_step_cpu_ms": round(run_step * 1e3, 2),
                                  "separate_linear_cpu_ms": round(lin * 1e3, 2),
                                  "run_step_over_linear": round(run_step / lin, 3),
                                  "linear_best_cpu_ms": round(best * 1e3, 2),
                                  "run_step_over_best_linear": round(run_step / best, 3),
                                  "state_mb": round(state / 2**20, 1),
                                  "kv_mb": round(kv / 2**20, 1),
                                  "stream_cpu_ms": round(stream * 1e3, 2),
                                  "floor_over_linear": round((pair_lin + stream) / pair_lin, 3),
                                  **{k: sbs[k] for k in ("weight_mb", "step_gbps", "read_gbps",
                                                         "step_over_read") if k in sbs}},
                                 family, threads))
    return out


def _emit(row: dict, family: str, threads: int) -> dict:
    row = {"benchmark": "engine", "peer": "llamacpp", "family": family, "threads": threads,
           "work": "roofline", **row}
    print(f"[bench engine] {row}", file=sys.stderr, flush=True)
    return row
