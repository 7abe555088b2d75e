"""One colocated engine process for `bench e2e`: runs its sessions, writes per-token times."""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from pathlib import Path

from baton.config import BatonConfig
from baton.engine.builder import build_engine
from baton.engine.loop import EngineLoop
from baton.engine.request import Request, SamplingParams
from bench.common import cpu_seconds, runqueue_wait_seconds
from bench.e2e import run_sessions
from bench.workload import Workload


def main(model: str, cfg_file: str, out: str, wl_json: str, sessions_json: str) -> None:
    wl = Workload(**json.loads(wl_json))
    loop = EngineLoop(build_engine(BatonConfig.load(cfg_file), model))
    sp = SamplingParams(max_tokens=wl.answer_len, ignore_eos=True)

    def submit(rid, ids, session):
        box: queue.Queue = queue.Queue()
        loop.submit(Request(rid, ids, sp, session), lambda o: box.put((o, time.perf_counter())))
        while True:
            o, at = box.get()
            yield list(o.new_token_ids), at
            if o.finished:
                return

    me = os.getpid()
    t0, cpu0, wait0 = time.perf_counter(), cpu_seconds(me), runqueue_wait_seconds(me)
    recs = run_sessions(submit, wl, json.loads(sessions_json))
    wall = time.perf_counter() - t0
    cpu, wait = cpu_seconds(me) - cpu0, runqueue_wait_seconds(me) - wait0
    loop.stop()
    Path(out).write_text(json.dumps({"records": recs, "wall": wall, "cpu_s": cpu, "wait_s": wait}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
