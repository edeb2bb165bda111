#!/bin/bash
# Alternate build variants of the CPU 2:4 extension, each run in its own process, ROUNDS times (default 2), so
# that a slow spell of the machine falls on all of them (docs/results/cpu24-notes.md §14-17). Each argument is
# one variant, "TAG FLAG..." quoted; the options of cpu24_variant.py come from OPTS. Pause everything else first.
#   OPTS="--rows 1 --threads 1" benchmarks/dev/ab_rounds.sh "pf32 -DCAST_PF_GATHER=32" "pf128 -DCAST_PF_GATHER=128"
#   OPTS="--loop fp32" benchmarks/dev/ab_rounds.sh "f0 -DCAST_PF_F32=0" "f8k -DCAST_PF_F32=8192"
set -euo pipefail
cd "$(dirname "$0")/../.."
for _ in $(seq "${ROUNDS:-2}"); do
  for variant in "$@"; do
    # shellcheck disable=SC2086  # the variant and OPTS split into words on purpose
    .venv/bin/python benchmarks/dev/cpu24_variant.py $variant ${OPTS:-}
  done
done
