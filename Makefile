# codi-trace: the two commands of the README, and a few more.
#   make run    create .venv, install, run the whole pipeline (dvc repro) on the embedded default
#   make test   create/reuse .venv, install, run the default test suite
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# No command of the project reaches the network by default (see docs/ORCHESTRATION.md, "Offline by default").
export DVC_NO_ANALYTICS := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export WANDB_SILENT := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: run test test-slow test-all install install-gpu gpu-wheels gpu-check-dry bench repro status compare git-repo

install: $(STAMP)

# The GPU extra (bitsandbytes: paged 8-bit AdamW, QLoRA) on top of `install`: install a CUDA torch first
# (README, "On your GPU"), then `make install-gpu`.
install-gpu: $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,gpu]'

# The wheels benchmarks/gpu_check.sh installs offline on a GPU machine that reaches no network (docs/GPU.md):
# exactly the packages it needs there and lacks, at constraints.txt's versions, for CPython 3.12 manylinux
# x86_64, into .whl/ (git-ignored): bitsandbytes (absent there) and transformers (there 5.17, which lacks what the
# stages use). Everything else the check runs without (dvc, dvclive, wandb, prefect, dask).
GPU_WHEELS := bitsandbytes transformers
WHEEL_DIR := .whl
gpu-wheels:
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)
	$(or $(wildcard $(BIN)/python),python3) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux1_x86_64 -d $(WHEEL_DIR) \
	  $$(for w in $(GPU_WHEELS); do grep -m1 -E "^$$w==" constraints.txt || { echo "error: $$w is not pinned in constraints.txt" >&2; exit 1; }; done)
	@ls -l $(WHEEL_DIR); du -cb $(WHEEL_DIR)/*.whl | tail -1 | awk '{ printf "wheels: %.1f MiB together\n", $$1 / 1048576 }'

# The GPU check's CPU dry run: every section at tiny shapes, the GPU profile through the stages (~3 min on 2 cores).
gpu-check-dry: $(STAMP)
	bash benchmarks/gpu_check.sh --device cpu --tiny

# The stamp is rebuilt when the dependency pins change. constraints.txt pins the whole resolved
# environment; torch==2.13.0 there matches a CPU or CUDA build alike.
$(STAMP): pyproject.toml constraints.txt
	@test -n "$(PYTHON)" || { echo "error: python3.11 not found" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $@

# DVC needs a git repository. A clone is one; an unpacked tarball is made one here (one commit of
# the tree as it is), so that `dvc repro` and `dvc exp` work the same way.
git-repo:
	@git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { \
	  echo "not a git repository: initialising one (git init + one commit of this tree)"; \
	  git init -q && git add -A && \
	  git -c user.name=codi-trace -c user.email=codi-trace@localhost commit -qm "import codi-trace"; }

run: $(STAMP) git-repo
	$(BIN)/dvc repro
	@$(BIN)/dvc status
	@test -f metrics/eval.md && cat metrics/eval.md || true

test: $(STAMP) git-repo
	$(BIN)/python -m pytest

test-slow: $(STAMP) git-repo
	$(BIN)/python -m pytest -m slow

test-all: $(STAMP) git-repo
	$(BIN)/python -m pytest -m "slow or not slow"

# The experiments side by side: the params that differ and the evaluation, nothing else.
EXP_DROP := Created|.*_loss.*|metrics/(codi|sft|sft_direct|precompute|extract)\.json:.*|dvclive/.*|train\..*|eval\..*|summary\..*|step|val_.*|examples_per_s|tokens_per_s|train_runtime_s|steps|examples|(humaneval|synthetic|total|tokens|splits|dropped)\..*|vocab_size|.*\.n$$|.*_time_ms|.*first_error.*|models/.*|data/.*|codi/.*
compare: $(STAMP)
	@$(BIN)/dvc exp show --md --no-pager --only-changed --drop '$(EXP_DROP)' --keep '(explicit|latent|direct)\.output_accuracy(_lo|_hi)?|retention(_lo|_hi)?'

bench: $(STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done
	@echo "== benchmarks/roofline.py"; $(BIN)/python benchmarks/roofline.py

repro: $(STAMP) git-repo
	$(BIN)/dvc repro

status: $(STAMP)
	$(BIN)/dvc status
