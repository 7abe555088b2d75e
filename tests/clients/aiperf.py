"""AIPerf against Baton's chat endpoint, streaming, with the model folder's tokenizer.

AIPerf makes its synthetic prompts with that tokenizer and reads the server's `usage` from the
stream; those counts must equal what the router counted (baton_router_*_tokens). Its own count
of the output text (re-tokenized) is printed, not compared: a random model's token sequence
re-tokenizes to other merges."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

from tests.clients.lm_eval import env

REQUESTS = 16
OUTPUT_TOKENS = 12
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
           "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--artifact-dir", str(out), "--ui", "none"]
    log = work / "aiperf.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(work, False),
                            timeout=900).returncode
    if rc != 0:
        raise RuntimeError(f"aiperf exited {rc}:\n" + "\n".join(log.read_text().splitlines()[-15:]))
    (summary,) = list(out.rglob("profile_export_aiperf.json"))
    return json.loads(summary.read_text())


def _total(summary: dict, key: str) -> float | None:
    value = summary.get(key)
    return value.get("avg") if isinstance(value, dict) else value


def check(ai_bin: Path, work: Path, model: Path, http: str) -> list[str]:
    before = router_tokens(http)
    try:
        summary = profile(ai_bin, work, model, http)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
        return [str(e)]
    after = router_tokens(http)
    served = {k: after[k] - before[k] for k in COUNTERS}
    got = {"completed requests": _total(summary, "completed_request_count"),
           "prompt tokens (usage)": _total(summary, "total_usage_prompt_tokens"),
           "completion tokens (usage)": _total(summary, "total_usage_completion_tokens")}
    want = {"completed requests": REQUESTS,
            "prompt tokens (usage)": served["baton_router_prompt_tokens_total"],
            "completion tokens (usage)": served["baton_router_generation_tokens_total"]}
    print(f"test-clients: aiperf {got}, errors {summary.get('error_summary')}; the router "
          f"counted {want}; aiperf's own count of the output text: "
          f"{_total(summary, 'total_output_tokens')} tokens", flush=True)
    bad = []
    if summary.get("error_summary"):
        bad.append(f"aiperf reported errors: {summary['error_summary']}")
    for k, v in want.items():
        if got[k] != v:
            bad.append(f"aiperf {k}: {got[k]}, the router's: {v}")
    if served["baton_router_generation_tokens_total"] != REQUESTS * OUTPUT_TOKENS:
        bad.append(f"the router generated {served['baton_router_generation_tokens_total']} "
                   f"tokens for {REQUESTS} requests of {OUTPUT_TOKENS} (ignore_eos)")
    return bad
