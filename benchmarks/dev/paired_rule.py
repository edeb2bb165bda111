"""What the dispatcher's paired sign rule changes: TinyLlama-1.1B's four linear shapes (bf16, random 2:4 weights),
each key timed as the dispatcher times it (``measure_gemms_rounds``: interleaved rounds, weights cycled past the
cache), ``REPEATS`` fresh timings a key; for each, the choice by medians alone (the rule before: the fastest 2:4
candidate if its median is 10 % below dense's) and by the paired rule (``choose_kernel`` with the rounds), and in
how many rounds the median rule's pick beat dense. A layer that keeps its dense copy is the case (dense, the
careful dense kernel and every CPU 2:4 path are candidates).

    python benchmarks/dev/paired_rule.py [threads] [repeats]
"""

from __future__ import annotations

import json
import sys

import torch

from cast_llm.deploy.sparse24.dispatch import CPU_MIN_SPEEDUP, DENSE, choose_kernel, paired_ratios
from cast_llm.deploy.sparse24.kernels import CPU_KERNELS, available_kernels
from cast_llm.deploy.sparse24.timing import measure_gemms_rounds

SHAPES = {"q_proj/o_proj": (2048, 2048), "k_proj/v_proj": (256, 2048), "gate/up": (5632, 2048), "down": (2048, 5632)}


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.set_num_threads(threads)
    dt, cpu = torch.bfloat16, torch.device("cpu")
    kernels, _ = available_kernels(cpu, dt, CPU_KERNELS)
    candidates = [DENSE, "dense-careful", *(k for k in kernels if k != "cpu-unpack")]
    print(f"{threads} threads; candidates: {', '.join(candidates)}", flush=True)
    rows = []
    for name, (o, i) in SHAPES.items():
        for tokens in (16, 128, 512):
            for r in range(repeats):
                got = measure_gemms_rounds(candidates, o, i, dt, tokens, "eager", cpu)
                secs = {k: s for k, (s, _, _) in got.items()}
                rounds = {k: rr for k, (_, _, rr) in got.items() if rr}
                by_median = choose_kernel(secs, candidates, CPU_MIN_SPEEDUP)
                paired = choose_kernel(secs, candidates, CPU_MIN_SPEEDUP, rounds)
                ratios = paired_ratios(rounds, by_median) if by_median != DENSE else None
                row = {"shape": name, "out": o, "in": i, "tokens": tokens, "repeat": r, "by_median": by_median,
                       "paired": paired, "median_speedup": secs[DENSE] / secs[by_median],
                       "round_ratios": ratios}
                rows.append(row)
                won = "" if ratios is None else f", beat dense in {sum(x > 1 for x in ratios)}/{len(ratios)} rounds"
                print(f"{name:<14} {tokens:>4} tok #{r}: medians -> {by_median} ({row['median_speedup']:.2f}x{won}); "
                      f"paired rule -> {paired}", flush=True)
    changed = [x for x in rows if x["by_median"] != x["paired"]]
    print(f"{len(changed)} of {len(rows)} timings chose differently under the paired rule")
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            json.dump({"threads": threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
