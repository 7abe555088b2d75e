# Baton: every target creates .venv with all dependencies when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.baton-installed

.PHONY: serve test test-deploy test-clients bench bench-handoff lint venv clean train-models \
	ship-models

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: pip takes the CPU build from this machine's disk.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench,train]'
	touch $(STAMP)

# the trained NemotronH once it is shipped (docs/training.md), else the seeded `tiny`
SERVE_MODEL ?= $(if $(wildcard baton/models_data/code-nemotron_h/config.json),code-nemotron_h,tiny)

serve: $(STAMP)
	$(BIN)/baton serve --model $(SERVE_MODEL)

# Two pytest workers, a test file each at a time (its module fixtures stay in one process):
# one process keeps about 1.2 of 2 cores busy (it waits on its clusters' processes), two
# keep both busy. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -x --durations=15 -n $(TEST_WORKERS) --dist loadfile

# deploy/slurm/baton.sbatch under a real single-host Slurm (installs slurm-wlm + munge, root)
test-deploy: $(STAMP)
	$(BIN)/python -m tests.support.slurm

# lm-eval and AIPerf (their own venvs under ~/.cache/baton/venvs, never .venv) against a cluster
test-clients: $(STAMP)
	$(BIN)/python -m tests.clients.run

# the two small models (docs/training.md): both at once, one core each, about 2 hours;
# run it again after an interruption and each resumes from its last checkpoint
train-models: $(STAMP)
	mkdir -p runs
	$(BIN)/baton train --family nemotron_h --out runs/code-nemotron_h >> runs/code-nemotron_h.log 2>&1 & \
	$(BIN)/baton train --family qwen3_5 --out runs/code-qwen3_5 >> runs/code-qwen3_5.log 2>&1 & \
	wait

# copy the finished runs into baton/models_data/ (minus .train/, the family's chat template,
# bf16, 25 MB together at most): then commit that folder
ship-models: $(STAMP)
	$(BIN)/python -m baton.train.ship --runs runs

bench: $(STAMP)
	$(BIN)/baton bench all --out bench/results

# What disaggregation adds to time to first token (1 prefill + 1 decode worker, `baton serve`'s
# config, against colocated), phase by phase: a short run (about a minute) that prints the
# figure and never fails on it (a shared machine's timings are no verdict). docs/performance-handoff.md
bench-handoff: $(STAMP)
	-$(BIN)/python -m bench.handoff --profile serve --modes whole --sizes 512 2048 8192 \
		--trials 3 --idle-s 5

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) bench/results
