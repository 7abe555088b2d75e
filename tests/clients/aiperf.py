"""AIPerf against Baton's chat endpoint, streaming, with the model folder's tokenizer."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

from tests.clients.lm_eval import env

REQUESTS = 16
COUNTERS = ("baton_router_prompt_tokens_total", "baton_router_generation_tokens_total")


def router_tokens(http: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{http}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def profile(ai_bin: Path, work: Path, model: Path, http: str) -> dict:
    out = work / "aiperf"
    cmd = [str(ai_bin / "aiperf"), "profile", "--model", "tiny", "--url", http,
           "--endpoint-type", "chat", "--streaming", "--tokenizer", str(model),
           "--request-count", str(REQUESTS), "--concurrency", "4", "--random-seed", "7",
           "--synthetic-input-tokens-mean", "48", "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", "12", "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--artifact-dir", str(out), "--ui", "none"]
    log = work / "aiperf.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(work),
                            timeout=900).returncode
    if rc != 0:
        raise RuntimeError(f"aiperf exited {rc}:\n" + "\n".join(log.read_text().splitlines()[-15:]))
    (summary,) = list(out.rglob("profile_export_aiperf.json"))
    return json.loads(summary.read_text())


def check(ai_bin: Path, work: Path, model: Path, http: str) -> list[str]:
    before = router_tokens(http)
    try:
        summary = profile(ai_bin, work, model, http)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
        return [str(e)]
    after = router_tokens(http)
    served = {k: after[k] - before[k] for k in COUNTERS}
    print(f"test-clients: aiperf summary keys {sorted(summary)[:40]}; router {served}", flush=True)
    return []
