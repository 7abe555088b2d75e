"""How the multi-turn workload's requests reach the engine in `bench reuse` (8 in flight):

    turns      every session's turn t together, turn after turn: waves of alike requests
    staggered  conversations start one after another, each runs its turns back to back, so
               first turns (full prefills) arrive among later turns that are mostly cached
    burst      one conversation's last turn (mostly cached) arrives together with 7 new long
               prompts, once at each of the 8 queue positions; only its TTFT is counted

Each returns prefill tokens computed, the oracle's minimum, and the mean TTFT per turn, in wall
milliseconds and in CPU milliseconds of the engine thread.
"""

from __future__ import annotations

import random
import time
from collections import deque

from bench.workload import Workload, oracle_tokens


class Recorder:
    def __init__(self):
        self.computed = self.oracle = 0
        self.wall: dict[int, list[float]] = {}
        self.cpu: dict[int, list[float]] = {}

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def first_token(self, turn: int, t0: tuple[float, float]) -> None:
        self.wall.setdefault(turn, []).append((time.perf_counter() - t0[0]) * 1000)
        self.cpu.setdefault(turn, []).append((time.thread_time() - t0[1]) * 1000)

    def result(self) -> dict:
        return {"computed": self.computed, "oracle": self.oracle,
                "ttft_ms": {t: sum(v) / len(v) for t, v in self.wall.items()},
                "ttft_cpu_ms": {t: sum(v) / len(v) for t, v in self.cpu.items()}}


def _sampling(wl: Workload):
    from baton.engine.request import SamplingParams

    return SamplingParams(max_tokens=wl.answer_len, ignore_eos=True)


def turns(eng, wl: Workload, conc: int) -> dict:
    rec, history, seen = Recorder(), {s: wl.system_prompt(s) for s in range(wl.sessions)}, []
    for turn in range(wl.turns):
        prompts = {s: history[s] + wl.message(s, turn) for s in range(wl.sessions)}
        for s in range(wl.sessions):
            rec.oracle += oracle_tokens(prompts[s], seen)
            seen.append(prompts[s])
        for s, (toks, cached) in _run_turn(eng, prompts, _sampling(wl), conc, turn, rec).items():
            rec.computed += len(prompts[s]) - cached
            history[s] = prompts[s] + toks
            seen.append(history[s])
    return rec.result()


def _run_turn(eng, prompts, sp, conc, turn, rec: Recorder):
    from baton.engine.request import Request

    pending, live, out = sorted(prompts), {}, {}
    while pending or live:
        while pending and len(live) < conc:
            s = pending.pop(0)
            eng.add_request(Request(f"s{s}-t{turn}", prompts[s], sp, session=f"s{s}"))
            live[f"s{s}-t{turn}"] = (s, [], rec.now())
        for o in eng.step():
            s, toks, t0 = live[o.request_id]
            if not toks:
                rec.first_token(turn + 1, t0)
            toks.extend(o.new_token_ids)
            if o.finished:
                out[s] = (toks, o.cached_tokens)
                del live[o.request_id]
    return out


def staggered(eng, wl: Workload, conc: int) -> dict:
    from baton.engine.request import Request

    rec, sp, seen = Recorder(), _sampling(wl), []
    every = max(1, wl.turns * (wl.answer_len + 4) // conc)  # engine steps between two starts
    ready: deque[tuple[int, int, list[int]]] = deque()
    live: dict[str, tuple] = {}
    step = done = 0
    while done < wl.sessions * wl.turns:
        if step % every == 0 and step // every < wl.sessions:
            s = step // every
            ready.append((s, 0, wl.system_prompt(s) + wl.message(s, 0)))
        while ready and len(live) < conc:
            s, turn, ids = ready.popleft()
            rec.oracle += oracle_tokens(ids, seen)
            seen.append(ids)
            eng.add_request(Request(f"s{s}-t{turn}", ids, sp, session=f"s{s}"))
            live[f"s{s}-t{turn}"] = (s, turn, ids, [], rec.now())
        for o in eng.step():
            s, turn, ids, toks, t0 = live[o.request_id]
            if not toks:
                rec.first_token(turn + 1, t0)
            toks.extend(o.new_token_ids)
            if o.finished:
                del live[o.request_id]
                done += 1
                rec.computed += len(ids) - o.cached_tokens
                seen.append(ids + toks)
                if turn + 1 < wl.turns:
                    ready.append((s, turn + 1, ids + toks + wl.message(s, turn + 1)))
        step += 1
    return rec.result()


def burst(eng, wl: Workload, conc: int) -> dict:
    from baton.engine.request import Request

    rec, sp = Recorder(), _sampling(wl)
    history = wl.system_prompt(0)
    for turn in range(wl.turns - 1):  # the conversation so far, alone
        ids = history + wl.message(0, turn)
        history = ids + _alone(eng, Request(f"warm-t{turn}", ids, sp, session="s0"))
    rng = random.Random(wl.seed + 17)
    for k in range(conc):
        # a new last message each time, so no burst reuses what an earlier one computed
        last = history + [rng.randrange(3, wl.vocab) for _ in range(wl.message_len)]
        fresh = [[rng.randrange(3, wl.vocab) for _ in last] for _ in range(conc - 1)]
        batch = [*fresh[:k], last, *fresh[k:]]
        for i, ids in enumerate(batch):
            eng.add_request(Request(f"b{k}-{i}", ids, sp, session="s0" if i == k else None))
        t0 = rec.now()
        cached = _first_token_of(eng, f"b{k}-{k}")
        rec.first_token(wl.turns, t0)
        rec.computed += len(last) - cached
        rec.oracle += oracle_tokens(last, [history])
        for i in range(conc):
            eng.abort(f"b{k}-{i}")
    return rec.result()


def _alone(eng, req) -> list[int]:
    eng.add_request(req)
    toks, done = [], False
    while not done:
        for out in eng.step():
            toks.extend(out.new_token_ids)
            done = out.finished
    return toks


def _first_token_of(eng, request_id: str) -> int:
    """Steps until `request_id` has its first token; returns its cached prompt tokens."""
    while True:
        for o in eng.step():
            if o.request_id == request_id:
                return o.cached_tokens
