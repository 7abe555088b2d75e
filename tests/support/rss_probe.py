"""A worker's resident memory, measured in its own process: `python -m tests.support.rss_probe
MODEL_DIR [int8|int4|float32]` builds the engine a worker builds (`build_engine`) and prints one
JSON line:

    base_kb       RSS with torch and Baton's kernels loaded, before the model
    rss_kb        RSS once the engine is built (weights, pools)
    anon_kb       anonymous RSS then (file pages of the checkpoint not counted)
    peak_anon_kb  the most anonymous RSS seen while loading (sampled every 5 ms)
    weight_bytes  the engine's own count of its weights' bytes

`tests/unit/model/quant/test_packed_memory.py` and `python -m bench.quant_memory` run it."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def main(argv: list[str]) -> None:
    model, mode = argv[0], argv[1] if len(argv) > 1 else "float32"
    import torch

    from baton.config import BatonConfig
    from baton.engine.builder import build_engine
    from baton.model.layers import cpu_kernels, step_kernels

    cpu_kernels.gemv(), step_kernels.kernels()
    torch.zeros(1) @ torch.zeros(1, 1).T
    base, base_anon = _status("VmRSS"), _status("RssAnon")
    peak, done = [_status("RssAnon")], threading.Event()

    def sample():
        while not done.wait(0.005):
            peak[0] = max(peak[0], _status("RssAnon"))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    cfg = BatonConfig.from_dict({
        "model": {"quantize": None if mode == "float32" else mode},
        "cache": {"num_blocks": 8, "num_state_slots": 2, "enable_prefix_reuse": False},
        "worker": {"max_num_seqs": 2, "max_model_len": 128}})
    engine = build_engine(cfg, model)
    done.set()
    t.join()
    print(json.dumps({"base_kb": base, "base_anon_kb": base_anon, "rss_kb": _status("VmRSS"), "anon_kb": _status("RssAnon"),
                      "peak_anon_kb": max(peak[0], _status("RssAnon")),
                      "weight_bytes": engine.weights.bytes}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
