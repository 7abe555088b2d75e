"""The llama.cpp side of `bench engine --peer llamacpp`, run by the peer's own venv python.

It imports nothing from Baton (that venv has only llama-cpp-python and numpy). One JSON
command per stdin line, one JSON answer per stdout line:

    {"op": "load", "gguf": PATH, "threads": T, "n_seq": S, "n_ctx": C}
    {"op": "greedy", "prompt": [ids], "steps": N}       -> tokens, margins (top1 - top2)
    {"op": "prefill", "prompt": [ids]}                   -> wall_s, cpu_s
    {"op": "decode", "prompts": [[ids], ...], "steps": N} -> wall_s, cpu_s of the N steps
    {"op": "logits", "prompt": [ids], "out": PATH}       -> n, vocab; PATH holds every
                                                            position's logits, float32 [n, vocab]
    {"op": "quit"}

Decode runs all sequences as one batch per step (one `llama_decode` of S tokens), the way a
serving engine built on llama.cpp batches; the prompts' prefill is not in the timed part.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import llama_cpp as L
import numpy as np


def _waited() -> float:
    """Seconds this process's threads sat runnable waiting for a CPU (schedstat field 2)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError):
            pass
    return total / 1e9


def _timed(fn) -> dict:
    w0, c0, t0 = _waited(), time.process_time(), time.perf_counter()
    fn()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "wait_s": _waited() - w0}


class Peer:
    def __init__(self, gguf: str, threads: int, n_seq: int, n_ctx: int):
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max = n_ctx, n_seq
        cp.n_batch = cp.n_ubatch = 2048
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True  # one cell pool for all sequences: a 2k prompt fits beside 32
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} x {n_seq}")
        self.batch = L.llama_batch_init(2048, 0, n_seq)

    def clear(self) -> None:
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def _run(self, toks: list[tuple[int, int, int, bool]]) -> None:
        """Decode (token, position, sequence, wants logits) rows, at most 2048 per call."""
        for start in range(0, len(toks), 2048):
            part = toks[start:start + 2048]
            b = self.batch
            for i, (t, p, s, want) in enumerate(part):
                b.token[i], b.pos[i], b.n_seq_id[i] = t, p, 1
                b.seq_id[i][0], b.logits[i] = s, want
            b.n_tokens = len(part)
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, i: int) -> np.ndarray:
        ptr = L.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                     shape=(self.n_vocab,)).copy()

    def prefill_rows(self, prompt: list[int], seq: int = 0, last: bool = True):
        return [(t, p, seq, last and p == len(prompt) - 1) for p, t in enumerate(prompt)]

    def greedy(self, prompt: list[int], steps: int) -> dict:
        self.clear()
        self._run(self.prefill_rows(prompt))
        toks, margins, pos = [], [], len(prompt)
        for _ in range(steps):
            lg = self._logits(-1)
            top = np.argsort(lg)[-2:]
            toks.append(int(top[1]))
            margins.append(float(lg[top[1]] - lg[top[0]]))
            self._run([(toks[-1], pos, 0, True)])
            pos += 1
        return {"tokens": toks, "margins": margins}

    def logits(self, prompt: list[int], out: str) -> dict:
        """Every position's logits of one forward over `prompt` (llama.cpp's own, as its
        `logits_all` gives them), written raw to `out`: a file, not a JSON line, for their size."""
        if len(prompt) > 2048:
            raise ValueError(f"logits of {len(prompt)} tokens: at most 2048 (one batch)")
        self.clear()
        self._run([(t, p, 0, True) for p, t in enumerate(prompt)])
        ptr = L.llama_get_logits(self.ctx)
        lg = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                   shape=(len(prompt), self.n_vocab))
        lg.astype(np.float32).tofile(out)
        return {"n": len(prompt), "vocab": self.n_vocab}

    def prefill(self, prompt: list[int]) -> dict:
        self.clear()
        return _timed(lambda: (self._run(self.prefill_rows(prompt)), self._logits(-1)))

    def decode(self, prompts: list[list[int]], steps: int) -> dict:
        self.clear()
        for s, p in enumerate(prompts):
            self._run(self.prefill_rows(p, s))
        last = [int(np.argmax(self._logits(-1)))] * len(prompts)  # any valid token will do
        pos = [len(p) for p in prompts]

        def steps_():
            nonlocal last, pos
            for _ in range(steps):
                self._run([(last[s], pos[s], s, True) for s in range(len(prompts))])
                last = [int(np.argmax(self._logits(s))) for s in range(len(prompts))]
                pos = [p + 1 for p in pos]
        return _timed(steps_)


def main() -> int:
    peer = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "quit":
                return 0
            if op == "load":
                peer = Peer(cmd["gguf"], cmd["threads"], cmd["n_seq"], cmd["n_ctx"])
                out = {"ok": True, "system": L.llama_print_system_info().decode()}
            else:
                out = getattr(peer, op)(**cmd)
        except Exception as e:  # noqa: BLE001 - the bench reports it as one line
            out = {"error": f"{op}: {e!r}"}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
