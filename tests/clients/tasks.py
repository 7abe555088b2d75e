"""Two lm-eval tasks written locally (no download): multiple choice (loglikelihood, as MMLU is
scored) and generate_until, on small seeded question sets, loaded by the `json` dataset
builder from files beside the task YAML."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["river", "paris", "seven", "green", "model", "token", "cache", "prime", "winter",
         "spider", "moon", "eight", "water", "light", "train", "answer"]

MC_YAML = """\
task: baton_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""

GEN_YAML = """\
task: baton_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _mc(rng: random.Random, i: int) -> dict:
    picks = rng.sample(WORDS, 4)
    return {"question": f"Which word is number {i % 4 + 1} in: {', '.join(picks)}?",
            "choices": [f" {w}" for w in picks], "answer": i % 4}


def _gen(rng: random.Random, i: int) -> dict:
    a, b = rng.randrange(10), rng.randrange(10)
    return {"question": f"What is {a} plus {b}?", "answer": f" {a + b}"}


def write_tasks(folder: Path, mc: int = 24, gen: int = 8, seed: int = 0) -> Path:
    """The tasks' YAML and data files in `folder` (lm-eval's --include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for name, make, n, yaml in (("mc", _mc, mc, MC_YAML), ("gen", _gen, gen, GEN_YAML)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(make(rng, i)) + "\n" for i in range(n)))
        (folder / f"baton_{name}.yaml").write_text(yaml.format(data=data))
    return folder


NEXTLINE_YAML = """\
task: baton_nextline
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def _nextline_docs(n: int, seed: int, context_lines: int = 8) -> list[dict]:
    """`n` questions from the committed held-out text (baton/train/data/heldout.jsonl): the
    `context_lines` lines before a line, and that line among three others of the same file
    (distinct, at least 8 characters without indentation), each choice a whole line with its
    newline; the true one's place drawn from `seed`."""
    from baton.train.corpus import heldout

    rng = random.Random(seed)
    docs = heldout()
    out = []
    while len(out) < n:
        lines = docs[len(out) % len(docs)].text.splitlines(keepends=True)
        ok = [i for i in range(context_lines, len(lines)) if len(lines[i].strip()) >= 8]
        i = rng.choice(ok)
        true = lines[i]
        others = sorted({lines[j] for j in ok} - {true})
        choices = rng.sample(others, 3)
        answer = rng.randrange(4)
        choices.insert(answer, true)
        out.append({"context": "".join(lines[i - context_lines : i]), "choices": choices,
                    "answer": answer})
    return out


def write_nextline_task(folder: Path, n: int = 96, seed: int = 0) -> Path:
    """lm-eval's `baton_nextline` (pick the true next line of held-out code among four) in
    `folder` (its --include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "nextline.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in _nextline_docs(n, seed)))
    (folder / "baton_nextline.yaml").write_text(NEXTLINE_YAML.format(data=data))
    return folder
