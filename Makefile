# Commands: `make train`; `make test` (the suite less its `slowest` tier), `make test-slow` (that tier),
# `make test-isa` (the precision-sensitive tests under each CPU instruction set), `make test-all` (the three)
# and `make test-fast` (the edit loop); all create the virtual environment when missing. CI (.ci/run) runs
# test, test-slow and test-isa without its native row (the two tiers before it ran those tests natively).
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU machines get the CPU build on disk; GPU users install their CUDA torch into the venv first
# (see README), and this line then installs nothing more because torch>=2.6 is already satisfied.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.meshlm-installed
# Python writes its bytecode caches (__pycache__, git-ignored) even where the environment says not to: the
# suite starts some 400 Python processes (launches, their workers, CLI runs), each of which would compile
# meshlm's sources again (0.15-0.2 CPU-s each), and each pytest run would rewrite every test module again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: train test test-slow test-isa test-all test-fast setup clean recipes

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/meshlm train --checkpoint.every 300 $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slowest" $(PYTEST_ARGS)

# the longest tests (marker `slowest` in pyproject.toml, tests/conftest.py SLOWEST), left out of `make test`
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slowest $(PYTEST_ARGS)

# the tests marked `isa` (bf16, fp16, fp8, int8 trajectories) once per CPU instruction set torch offers here:
# the machine's defaults, AVX-512 without AMX, AVX2 (tests/isa_matrix.py; rows the CPU lacks are skipped, saying so;
# ISA_ARGS="--skip native" leaves out the defaults' row, as CI does after test and test-slow)
test-isa: $(STAMP)
	$(PY) tests/isa_matrix.py $(ISA_ARGS) $(PYTEST_ARGS)

# every tier, as CI runs them (and the native isa row too)
test-all: test test-slow test-isa

# the edit loop: no worker pools but one equivalence row per dimension, no compile, no launches (marker
# `slow` in pyproject.toml, tests/conftest.py); `make test` before pushing
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# the planner's estimates in the headers of configs/*.toml, from the `meshlm estimate` each names
recipes: $(STAMP)
	$(PY) bench/recipe_estimates.py

clean:
	rm -rf $(VENV) runs .pytest_cache
