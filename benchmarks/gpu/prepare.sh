#!/usr/bin/env bash
# GPU kit, step 1 (on this machine, with network): fill the ignored folder .gpu/ with what the GPU machine lacks
# — the wheels of the missing pure-Python dependencies (gguf), the embedded SmolLM2-135M GGUF in parts, the
# embedded corpus, the WikiText-2 test file unless it travels with src/ — one folder per device call, and print
# the exact device calls (command and carry of each) with each call's payload against the 64 MiB limit; the first
# is `bash benchmarks/gpu/run.sh setup perf` (issue 21's targets). After each call, merge what it returned:
# `python benchmarks/gpu/kit.py record FILES_AT`.
#
#   bash benchmarks/gpu/prepare.sh [--part-mib N] [--no-download] [--json]
#
# docs/gpu.md is the guide; benchmarks/gpu/kit.py (the package benchmarks/gpu/gpukit/) does the work.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
exec "$PY" benchmarks/gpu/kit.py prepare "$@"
