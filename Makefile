# Every target sets itself up on first use (idempotently) in .venv.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.usaf-installed
# A CPU build of PyTorch when none is installed; users bring their own CUDA/ROCm build.
TORCH_CPU ?= torch==2.13.0

.PHONY: setup test test-lowest demo bench bench-compare bench-quality bench-preference bench-scale bench-launches lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet $(TORCH_CPU)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The suite on every core with pytest-xdist: one worker a physical core (-n auto), at most TEST_MAX_WORKERS (each
# worker builds its own session fixtures and a distributed test starts 2 to 4 processes of its own), one torch thread
# a worker (tests/conftest.py). --dist loadscope keeps a module's tests on one worker, so that its module fixtures
# (trained runs) are built once. TEST_WORKERS=0 runs it in this process, as a plain `pytest` does.
TEST_WORKERS ?= auto
TEST_MAX_WORKERS ?= 4
XDIST = -n $(TEST_WORKERS) --maxprocesses=$(TEST_MAX_WORKERS) --dist loadscope

test: $(STAMP)
	$(BIN)/python -m pytest $(XDIST)

# The engine tests (and the import guard's) on the lowest transformers version pyproject.toml allows, read from its
# "transformers>=X" alone; installed beside .venv's own copy (not over it) and put first on the path.
LOWEST_TRANSFORMERS := $(shell sed -n 's/^ *"transformers>=\([0-9.]*\).*/\1/p' pyproject.toml)
LOWEST_DIR ?= $(VENV)/lowest-transformers
LOWEST_STAMP := $(LOWEST_DIR)/.installed-$(LOWEST_TRANSFORMERS)
LOWEST_TESTS ?= tests/engine tests/package/test_hf_guard.py tests/package/test_layers.py

$(LOWEST_STAMP): | $(STAMP)
	rm -rf $(LOWEST_DIR)
	$(BIN)/python -m pip install --quiet --no-deps --target $(LOWEST_DIR) "transformers==$(LOWEST_TRANSFORMERS)"
	touch $@

test-lowest: $(STAMP) $(LOWEST_STAMP)
	PYTHONPATH=$(LOWEST_DIR):src $(BIN)/python -c "import transformers as t; from packaging.version import Version as V; \
		assert V(t.__version__) == V('$(LOWEST_TRANSFORMERS)'), t.__version__; print('transformers', t.__version__)"
	# tests/export on the path: tests/engine/test_targets.py borrows test_export's helpers (found there in the full suite)
	PYTHONPATH=$(LOWEST_DIR):src:tests/export $(BIN)/python -m pytest $(XDIST) -m "not slow" $(LOWEST_TESTS)

demo: $(STAMP)
	$(BIN)/usaf demo

bench: $(STAMP)
	$(BIN)/python bench/engine.py
	$(MAKE) bench-launches

bench-compare: $(STAMP)
	$(BIN)/python bench/compare.py

bench-quality: $(STAMP)
	$(BIN)/python bench/quality.py

# usaf DPO at its defaults against PEFT LoRA and full DPO (TRL), three seeds (about 10 minutes on 2 cores)
bench-preference: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python bench/preference.py

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
