"""lm-eval against Baton (`local-completions`) and against transformers (`hf`), compared."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.clients.tasks import write_nextline_task, write_tasks

TASKS = "baton_mc,baton_gen"
LL_TOLERANCE = 1e-3


def env(work: Path, offline: bool = True) -> dict:
    """The tasks' data is local and the tokenizer is the model folder's: nothing is fetched
    (offline: the hub is never asked; AIPerf needs it off to load a local folder, which it
    then does without the network)."""
    out = {**os.environ, "HF_HOME": str(work / "hf-home"), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    if offline:
        out.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return out


def evaluate(lm_bin: Path, work: Path, name: str, model: str, model_args: str,
             batch_size: int, tasks: str = TASKS,
             include: str = "tasks") -> dict[str, dict[int, dict]]:
    """{task: {doc_id: sample}} from lm-eval's --log_samples files."""
    out = work / f"lm-eval-{name}"
    cmd = [str(lm_bin / "lm-eval"), "run", "--model", model, "--model_args", model_args,
           "--tasks", tasks, "--include_path", str(work / include), "--output_path", str(out),
           "--log_samples", "--batch_size", str(batch_size), "--seed", "1234"]
    if model == "hf":
        cmd += ["--device", "cpu"]
    log = work / f"lm-eval-{name}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(work),
                            timeout=1800).returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"lm-eval {name} exited {rc}:\n" + "\n".join(tail))
    samples: dict[str, dict[int, dict]] = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name[len("samples_"):].rsplit("_", 1)[0]
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        samples[task] = {r["doc_id"]: r for r in rows}
    return samples


def compare(baton: dict, hf: dict) -> list[str]:
    bad = []
    for task in ("baton_mc", "baton_gen"):
        a, b = baton.get(task, {}), hf.get(task, {})
        if not a or set(a) != set(b):
            bad.append(f"{task}: lm-eval scored {len(a)} docs on Baton, {len(b)} on hf")
            continue
        for doc in sorted(a):
            x, y = a[doc], b[doc]
            if task == "baton_mc":
                bad += _compare_mc(doc, x, y)
            elif x["filtered_resps"] != y["filtered_resps"]:
                bad.append(f"baton_gen doc {doc}: Baton generated {x['filtered_resps']!r}, "
                           f"hf {y['filtered_resps']!r}")
        metric = "acc" if task == "baton_mc" else "exact_match"
        acc = [sum(s[metric] for s in d.values()) / len(d) for d in (a, b)]
        if acc[0] != acc[1]:
            bad.append(f"{task} {metric}: Baton {acc[0]}, hf {acc[1]}")
    return bad


def _compare_mc(doc: int, x: dict, y: dict) -> list[str]:
    lx = [r[0] for r in x["filtered_resps"]]
    ly = [r[0] for r in y["filtered_resps"]]
    worst = max(abs(float(p) - float(q)) for p, q in zip(lx, ly, strict=True))
    if worst > LL_TOLERANCE:
        return [f"baton_mc doc {doc}: loglikelihoods differ by {worst:.2e} (> {LL_TOLERANCE}): "
                f"Baton {lx}, hf {ly}"]
    if x["acc"] != y["acc"]:
        return [f"baton_mc doc {doc}: acc Baton {x['acc']}, hf {y['acc']}"]
    return []


def _api_args(model: Path, http: str) -> str:
    """lm-eval's `local-completions` against Baton, tokenized with the folder's tokenizer
    (the model's served name is its folder's)."""
    return (f"model={model.name},base_url={http}/v1/completions,tokenizer={model},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2,"
            "max_retries=1,timeout=300")


def chance_bound(n: int, choices: int = 4) -> float:
    """Accuracy above chance: 1/choices plus 2.33 standard errors of n guesses (a guesser
    passes 1% of the time)."""
    p = 1 / choices
    return p + 2.33 * (p * (1 - p) / n) ** 0.5


def check_nextline(lm_bin: Path, work: Path, model: Path, http: str) -> list[str]:
    """`baton_nextline` (the true next line of held-out code among four) on a trained model:
    every loglikelihood within LL_TOLERANCE of lm-eval's `hf` backend on the same folder, the
    same accuracy, and that accuracy above chance."""
    write_nextline_task(work / "tasks-nextline")
    task, kw = "baton_nextline", {"tasks": "baton_nextline", "include": "tasks-nextline"}
    try:
        baton = evaluate(lm_bin, work, "nextline-baton", "local-completions",
                         _api_args(model, http), 4, **kw)
        hf = evaluate(lm_bin, work, "nextline-hf", "hf", f"pretrained={model},dtype=float32",
                      1, **kw)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return [str(e)]
    a, b = baton.get(task, {}), hf.get(task, {})
    if not a or set(a) != set(b):
        return [f"{task}: lm-eval scored {len(a)} docs on Baton, {len(b)} on hf"]
    bad = []
    for doc in sorted(a):
        bad += [m.replace("baton_mc", task) for m in _compare_mc(doc, a[doc], b[doc])]
    acc = {m: [sum(s[m] for s in d.values()) / len(d) for d in (a, b)]
           for m in ("acc", "acc_norm")}
    bound = chance_bound(len(a))
    print(f"test-clients: {task} on {model.name}: acc {acc['acc'][0]:.3f} (hf "
          f"{acc['acc'][1]:.3f}), acc_norm {acc['acc_norm'][0]:.3f} (hf {acc['acc_norm'][1]:.3f})"
          f", {len(a)} docs, chance 0.25, above chance from {bound:.3f}", flush=True)
    for m, (x, y) in acc.items():
        if x != y:
            bad.append(f"{task} {m}: Baton {x}, hf {y}")
    if acc["acc"][0] <= bound:
        bad.append(f"{task} acc {acc['acc'][0]:.3f} on {model.name} is not above chance "
                   f"(0.25; {bound:.3f} with {len(a)} docs)")
    return bad


def check(lm_bin: Path, work: Path, model: Path, http: str) -> list[str]:
    write_tasks(work / "tasks")
    # batch_size 4: four prompts a request, as lm-eval batches against an API
    api_args = _api_args(model, http)
    try:
        baton = evaluate(lm_bin, work, "baton", "local-completions", api_args, 4)
        hf = evaluate(lm_bin, work, "hf", "hf", f"pretrained={model},dtype=float32", 1)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return [str(e)]
    n_ll = sum(len(s["filtered_resps"]) for s in baton.get("baton_mc", {}).values())
    print(f"test-clients: lm-eval compared {n_ll} loglikelihoods and "
          f"{len(baton.get('baton_gen', {}))} generations", flush=True)
    return compare(baton, hf)
