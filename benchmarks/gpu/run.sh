#!/usr/bin/env bash
# GPU kit, step 2 (on the lent GPU machine, from the repository root the device tool runs in):
#
#   bash benchmarks/gpu/run.sh STAGE [STAGE ...] [kit options]
#
# STAGE: setup, perf, correctness, speed, quality, or all — run in this order of value whatever order they are
# named in. The first call of a lent session is `bash benchmarks/gpu/run.sh setup perf` (issue 21's targets, in
# one call). setup runs at every call: it copies what the call carried (.gpu/callK) into the kit folder on the
# machine's disk ($CAST_KIT_DIR, default $HOME/cast-kit, kept while the machine stays warm), reassembles and
# verifies (sha256) the files, installs the wheels with pip --no-index --target, checks the software and CUDA and
# converts the embedded model once into the project's cache. Finished steps are not run again; what needs more
# time than the call has left is deferred to the next call. The result files (at most 8) go to $OUT, rewritten
# after every step. Options: see `python3 benchmarks/gpu/kit.py run --help` (e.g. --session-left-s N for
# quality, --redo perf to measure again). docs/gpu.md is the guide.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}  # the image's interpreter, which holds torch
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"  # the package from the working tree (no install)
KIT=${CAST_KIT_DIR:-${HOME:-/root}/cast-kit}
mkdir -p "$KIT"
# a hard stop inside the device's 10-minute limit; the kit itself starts no work after 540 s
exec timeout -k 10 "${CAST_KIT_HARD_S:-585}" "$PY" benchmarks/gpu/kit.py run "$@" --kit-dir "$KIT" \
    --command "bash benchmarks/gpu/run.sh $*"
