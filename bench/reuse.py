"""`baton bench reuse`: prefill tokens and time to first token per turn, reuse off vs each policy."""

from __future__ import annotations

import sys
import time

from bench.common import checkpoint
from bench.workload import Workload, oracle_tokens

POLICIES = {
    "off": None,
    "final_prompt": {"additional_snapshot_offsets_from_end": [0], "decode_end_snapshot": False},
    "periodic_256": {"periodic_snapshot_interval": 256, "additional_snapshot_offsets_from_end": [0],
                     "decode_end_snapshot": False},
    "decode_end": {"additional_snapshot_offsets_from_end": [0], "decode_end_snapshot": True},
    "periodic_256_decode_end": {"periodic_snapshot_interval": 256,
                                "additional_snapshot_offsets_from_end": [0],
                                "decode_end_snapshot": True},
    "per_conversation": {"per_conversation": True, "max_num_turns": 6},
}


def _engine(path, policy, wl: Workload, conc: int):
    from baton.config import BatonConfig
    from baton.engine.builder import build_engine

    max_len = wl.system_len + wl.turns * (wl.message_len + wl.answer_len) + 16
    cache = {"num_blocks": 12 * max_len // 16 * conc + 64, "num_state_slots": 8 * wl.sessions + conc}
    if policy is None:
        cache["enable_prefix_reuse"] = False
    else:
        cache["mamba_state_config"] = policy
    cfg = BatonConfig.from_dict({
        "cache": cache,
        "worker": {"max_num_seqs": conc, "max_model_len": max_len + 64, "max_batch_tokens": 4096,
                   "prefill_chunk_size": 2048},
    })
    return build_engine(cfg, str(path))


def run_workload(eng, wl: Workload, conc: int) -> dict:
    from baton.engine.request import SamplingParams

    sp = SamplingParams(max_tokens=wl.answer_len, ignore_eos=True)
    history = {s: wl.system_prompt(s) for s in range(wl.sessions)}
    computed = oracle = 0
    ttft: dict[int, list[float]] = {}
    seen: list[list[int]] = []
    for turn in range(wl.turns):
        prompts = {s: history[s] + wl.message(s, turn) for s in range(wl.sessions)}
        for s in range(wl.sessions):
            oracle += oracle_tokens(prompts[s], seen)
            seen.append(prompts[s])
        outs = _run_turn(eng, prompts, sp, conc, turn)
        for s, (toks, cached, t) in outs.items():
            computed += len(prompts[s]) - cached
            ttft.setdefault(turn + 1, []).append(t)
            history[s] = prompts[s] + toks
            seen.append(history[s])
    return {"computed": computed, "oracle": oracle,
            "ttft_ms": {t: sum(v) / len(v) for t, v in ttft.items()}}


def _run_turn(eng, prompts, sp, conc, turn):
    from baton.engine.request import Request

    pending = sorted(prompts)
    live, out = {}, {}
    while pending or live:
        while pending and len(live) < conc:
            s = pending.pop(0)
            rid = f"s{s}-t{turn}"
            eng.add_request(Request(rid, prompts[s], sp, session=f"s{s}"))
            live[rid] = (s, [], time.perf_counter(), None)
        for o in eng.step():
            s, toks, t0, first = live[o.request_id]
            toks.extend(o.new_token_ids)
            first = first if first is not None else (time.perf_counter() - t0) * 1000
            live[o.request_id] = (s, toks, t0, first)
            if o.finished:
                out[s] = (toks, o.cached_tokens, first)
                del live[o.request_id]
    return out


def run(args) -> list[dict]:
    quick = getattr(args, "quick", False)
    wl = Workload(sessions=8, turns=4, system_len=256, message_len=96, answer_len=16) if quick \
        else Workload()
    path = checkpoint("tiny")
    conc = 8
    rows, base_ttft = [], None
    for name, policy in POLICIES.items():
        t0 = time.perf_counter()
        res = run_workload(_engine(path, policy, wl, conc), wl, conc)
        last = res["ttft_ms"][wl.turns]
        base_ttft = last if name == "off" else base_ttft
        row = {
            "benchmark": "reuse", "label": name, "policy": name, "sessions": wl.sessions,
            "turns": wl.turns, "prefill_tokens_computed": res["computed"],
            "oracle_tokens": res["oracle"],
            "computed_over_oracle": round(res["computed"] / res["oracle"], 3),
            "hit_rate_vs_oracle": round(res["oracle"] / res["computed"], 3),
            f"turn{wl.turns}_ttft_ms": round(last, 2),
            "ttft_ms_by_turn": {k: round(v, 2) for k, v in res["ttft_ms"].items()},
            "ratio": round(base_ttft / last, 2),
            "ratio_note": f"turn-{wl.turns} TTFT speed-up vs reuse off (target >= 5)",
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        print(f"[bench reuse] {row}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows
