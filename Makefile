# Every target sets itself up on first use (idempotently) in .venv.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.usaf-installed
# A CPU build of PyTorch when none is installed; users bring their own CUDA/ROCm build.
TORCH_CPU ?= torch==2.13.0

.PHONY: setup test demo bench bench-compare bench-quality bench-scale bench-launches lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet $(TORCH_CPU)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/usaf demo

bench: $(STAMP)
	$(BIN)/python bench/engine.py
	$(MAKE) bench-launches

bench-compare: $(STAMP)
	$(BIN)/python bench/compare.py

bench-quality: $(STAMP)
	$(BIN)/python bench/quality.py

# Qwen3-30B-A3B's layer shapes at 1 and 3 layers on the CPU, against the planner (under 10 minutes)
bench-scale: $(STAMP)
	$(BIN)/python bench/scale.py

# Ops and host syncs per layer-step at Qwen3-30B-A3B's layer shape (issue 22). The whole grid (36 configurations)
# takes about an hour on one CPU thread (18 min a density); LAUNCHES_ARGS narrows it, e.g.
# LAUNCHES_ARGS="--experts 32,128 --densities 1 --quant none" (6 min).
LAUNCHES_ARGS ?=
bench-launches: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python bench/launches.py $(LAUNCHES_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
