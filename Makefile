# Two commands a new user types: `make train` and `make test`.
# Each creates (or reuses) .venv, installs the pinned torch first (so pip never
# pulls a CUDA build it does not need here; on a GPU box the same pin gets the
# CUDA build), then the project, then runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.meshlm-installed

.PHONY: train test test-fast test-compat lint install gpu-check gpu-wheels

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
# Then the unit layer and the release-range runs under the oldest and the newest transformers of the supported
# range (meshlm/versions.py), each in its cached overlay (test-compat): about 100 s each on a quiet machine.
test: lint
	$(PY) -m compileall -q src benchmarks tests
	$(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --cpu-times tests
	$(MAKE) --no-print-directory test-compat TRANSFORMERS=5.17.0
	$(MAKE) --no-print-directory test-compat TRANSFORMERS=5.24.0

# The in-process layer alone (tests/unit: config, layout, launch options, planner, checkpoint, model split,
# import cycles), for the edit-test loop: ~3 CPU-minutes (179 s user + system over 475 tests), whose wall time
# follows the machine's load (two workers: 8.5 minutes on 2 cores shared with other jobs, load average 12-17).
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 tests/unit

# make test-compat TRANSFORMERS=5.17.0 [TORCH=2.11.0]: the subset that must hold on every release of the supported
# range, under that release, in an environment built once under COMPAT_CACHE (tests/compat_env.py: a pip --target
# overlay of transformers over this venv when TORCH is this venv's torch, else a venv of its own). In conftest.py's
# order, as `make test`'s run: test_release_range's launches first, then the costliest unit modules.
TRANSFORMERS ?= 5.17.0
TORCH ?= 2.13.0
COMPAT_CACHE ?= $(HOME)/.cache/meshlm-compat
COMPAT_TESTS ?= tests/unit tests/test_release_range.py
test-compat: $(STAMP)
	@env=$$($(PY) tests/compat_env.py --cache $(COMPAT_CACHE) --torch $(TORCH) --transformers $(TRANSFORMERS)) && \
	python=$$(echo "$$env" | sed -n 1p) && overlay=$$(echo "$$env" | sed -n 2p) && \
	echo "test-compat: torch $(TORCH), transformers $(TRANSFORMERS)" && \
	PYTHONPATH=src$${overlay:+:$$overlay} $$python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder \
		-p no:cacheprovider $(COMPAT_TESTS)

# ruff's linter and formatter (pyproject.toml [tool.ruff]), over every file.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# What only CUDA GPUs show, sized for one lease (benchmarks/gpu_check.py, docs/gpu.md): the machine's own python
# and torch as they are, no network; the torchao and torchtitan rows install their wheels from .whl alone. Writes
# gpu-check.md and gpu-check.json into $OUT where set (else here) after each row; exits 1 if a row failed.
# Without a GPU: one line saying so, exit 0. `python3 benchmarks/gpu_check.py --dry-run` shows what would run.
gpu-check:
	@PYTHONPATH=src $(PYTHON) benchmarks/gpu_check.py

# Here, with the registry: the wheels the lent GPU machine lacks (Python 3.12, torch 2.11) into .whl/.
gpu-wheels:
	@$(PYTHON) benchmarks/gpu_check.py --download-wheels
