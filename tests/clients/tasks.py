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
