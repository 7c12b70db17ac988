# Two commands a new user types: `make train` and `make test`.
# Each creates (or reuses) .venv, installs the pinned torch first (so pip never
# pulls a CUDA build it does not need here; on a GPU box the same pin gets the
# CUDA build), then the project, then runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshlm-installed

.PHONY: train test test-fast lint install gpu-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# ARGS: more `meshlm train` options, e.g. make train ARGS="--max-steps 50"
train: $(STAMP)
	$(VENV)/bin/meshlm train --nproc 2 $(ARGS)

# Two test processes (pytest-xdist), one test module each at a time (--dist loadscope): a module's shared
# training runs (module-scoped fixtures) then happen once. Most of the suite's CPU time is the Python processes
# it starts importing torch and transformers (tests/conftest.py run_cases: several runs per launch; meshlm's
# launcher forks its ranks from one process that imported them, launch.py).
# compileall first: on a machine with PYTHONDONTWRITEBYTECODE=1 (this one) Python never writes meshlm's
# bytecode, and every process would compile the package again. --cpu-times ends the run with CPU seconds per
# module and the launches made twice: the 20-minute budget, measured the way the machine's load barely changes.
# --no-loadscope-reorder keeps conftest.py's order (the costliest modules first), so the two workers end together.
test: lint
	$(PY) -m compileall -q src benchmarks tests
	$(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --cpu-times tests

# The in-process layer alone (tests/unit: config, layout, launch options, planner, checkpoint, model split,
# import cycles), for the edit-test loop: ~3 CPU-minutes (179 s user + system over 475 tests), whose wall time
# follows the machine's load (two workers: 8.5 minutes on 2 cores shared with other jobs, load average 12-17).
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 tests/unit

# ruff's linter and formatter (pyproject.toml [tool.ruff]), over every file.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# What only CUDA GPUs show, on the GPUs this machine has (benchmarks/gpu_check.py): the machine's own python
# and torch as they are (no venv, no installs, no network), but for the torchtitan check: it pip-installs torchtitan
# into a venv over those packages where this python lacks it. Writes gpu-check.md and gpu-check.json; exits 1
# if any check failed. Without a GPU: one line saying so, exit 0.
gpu-check:
	@PYTHONPATH=src $(PYTHON) benchmarks/gpu_check.py --out .
