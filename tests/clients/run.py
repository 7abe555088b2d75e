"""`make test-clients`: lm-eval, AIPerf and the openai-agents SDK, unmodified, against a Baton
cluster.

  1. the clients' venvs (tests/clients/venvs.py, cached; never the project's .venv)
  2. a seeded checkpoint with its tokenizer, a cluster on it (router + 1 prefill + 1 decode)
  3. lm-eval `local-completions` against Baton and lm-eval's `hf` backend on the same folder,
     on a multiple-choice and a generate task written here (tests/clients/tasks.py): accuracy
     identical, every per-choice loglikelihood within 1e-3, generations identical
  4. AIPerf (`--endpoint-type chat --streaming --tokenizer <model dir>`): 0 errors, and its
     token counts equal the router's (baton_router_*_tokens)
  5. the openai-agents SDK runs a tool loop over chat completions and the Responses API
     (tests/clients/agents_sdk.py)
  6. the trained model `code-nemotron_h` (skipped, saying so, while it is not shipped): a
     cluster on it, lm-eval's `baton_nextline` (the true next line of held-out code among
     four) on Baton and on `hf`: loglikelihoods within 1e-3, the same accuracy, above chance
Exit status 0 only when every check holds; each failed check is one line on stderr.
Usage: python -m tests.clients.run [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from tests.clients import agents_sdk, aiperf, lm_eval, venvs

CONFIG = """\
cache: {num_blocks: 1024, num_state_slots: 64}
worker: {max_num_seqs: 16, max_model_len: 2048}
transfer: {lease_seconds: 120.0}
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.clients.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", default=None, help="folder for the artifacts (default: a temp "
                                                 "folder, removed at the end)")
    ap.add_argument("--trained-only", action="store_true",
                    help="only step 6 (lm-eval's next-line task on the trained model)")
    args = ap.parse_args(argv)
    if args.trained_only:
        return _trained_only(args)
    t0 = time.monotonic()
    lm_bin, ai_bin = venvs.ensure(f"lm-eval-{venvs.LM_EVAL}"), venvs.ensure(f"aiperf-{venvs.AIPERF}")
    print(f"test-clients: lm-eval {venvs.version(lm_bin, 'lm_eval')}, aiperf "
          f"{venvs.version(ai_bin, 'aiperf')} ({time.monotonic() - t0:.0f} s to set up)",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="baton-clients-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        failures = run(work, lm_bin, ai_bin,
                       venvs.ensure(f"openai-agents-{venvs.OPENAI_AGENTS}"))
    for f in failures:
        print(f"test-clients: FAILED: {f}", file=sys.stderr)
    print(f"test-clients: {'FAILED' if failures else 'passed'} in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    return 1 if failures else 0


def _trained_only(args) -> int:
    t0 = time.monotonic()
    lm_bin = venvs.ensure(f"lm-eval-{venvs.LM_EVAL}")
    with tempfile.TemporaryDirectory(prefix="baton-clients-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("BATON_NUM_THREADS", "1")
        (work / "baton.yaml").write_text(CONFIG)
        failures = run_trained(work, lm_bin)
    for f in failures:
        print(f"test-clients: FAILED: {f}", file=sys.stderr)
    print(f"test-clients: {'FAILED' if failures else 'passed'} in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    return 1 if failures else 0


def run(work: Path, lm_bin: Path, ai_bin: Path, agents_bin: Path | None = None) -> list[str]:
    from baton.cluster.local import LocalCluster, free_port
    from baton.model.make_model import write_checkpoint

    os.environ.setdefault("BATON_NUM_THREADS", "1")
    model = write_checkpoint(work / "tiny", tokenizer=True)
    (work / "baton.yaml").write_text(CONFIG)
    cluster = LocalCluster(str(model), 1, 1, free_port(), str(work / "baton.yaml"),
                           log_level="WARNING")
    failures: list[str] = []
    try:
        cluster.wait_ready(timeout=240)
        t = time.monotonic()
        failures += lm_eval.check(lm_bin, work, model, cluster.http_address)
        print(f"test-clients: lm-eval done in {time.monotonic() - t:.0f} s", flush=True)
        t = time.monotonic()
        failures += aiperf.check(ai_bin, work, model, cluster.http_address)
        print(f"test-clients: aiperf done in {time.monotonic() - t:.0f} s", flush=True)
        if agents_bin is not None:
            t = time.monotonic()
            failures += agents_sdk.check(agents_bin, work, cluster.http_address)
            print(f"test-clients: openai-agents done in {time.monotonic() - t:.0f} s",
                  flush=True)
    finally:
        cluster.stop()
    failures += run_trained(work, lm_bin)
    return failures


TRAINED = "code-nemotron_h"


def run_trained(work: Path, lm_bin: Path) -> list[str]:
    """lm-eval's held-out next-line task on the shipped trained model, against a cluster on
    it (router + 1 prefill + 1 decode); [] with a line saying so when it is not shipped."""
    from baton.cluster.local import LocalCluster, free_port
    from baton.errors import ConfigError
    from baton.model.registry import resolve_model

    try:
        model = resolve_model(TRAINED)
    except ConfigError as e:
        print(f"test-clients: skipped the trained-model task: {e}", flush=True)
        return []
    cluster = LocalCluster(str(model), 1, 1, free_port(), str(work / "baton.yaml"),
                           log_level="WARNING")
    try:
        cluster.wait_ready(timeout=240)
        t = time.monotonic()
        failures = lm_eval.check_nextline(lm_bin, work, model, cluster.http_address)
        print(f"test-clients: lm-eval next-line task done in {time.monotonic() - t:.0f} s",
              flush=True)
    finally:
        cluster.stop()
    return failures


if __name__ == "__main__":
    sys.exit(main())
