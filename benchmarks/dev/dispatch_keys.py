"""The dispatcher's decisions on TinyLlama-1.1B's four linear shapes (bf16) for a layer that keeps its dense copy,
fresh (no cache), at 1 / 16 / 128 / 512 tokens: the kernel, its ratio to dense among all candidates and, where it
was timed again against dense alone, the head-to-head ratio (cpu24-notes.md §53-54).

    python benchmarks/dev/dispatch_keys.py [threads] [out.json]
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from cast_llm.deploy.sparse24.dispatch import DENSE, Dispatcher, paired_ratios
from cast_llm.deploy.sparse24.kernels import CPU_KERNELS, available_kernels

SHAPES = {"q_proj/o_proj": (2048, 2048), "k_proj/v_proj": (256, 2048), "gate/up": (5632, 2048), "down": (2048, 5632)}


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    cpu, dt = torch.device("cpu"), torch.bfloat16
    kernels, _ = available_kernels(cpu, dt, CPU_KERNELS)
    candidates = [DENSE, "dense-careful", *(k for k in kernels if k != "cpu-unpack")]
    d = Dispatcher(device=cpu)
    rows = []
    for name, (o, i) in SHAPES.items():
        for tokens in (1, 16, 128, 512):
            dec = d.decide(o, i, dt, tokens, "eager", candidates)
            among = {k: statistics.median(r) for k in dec.rounds if k != DENSE
                     if (r := paired_ratios(dec.rounds, k))}
            best = max(among, key=among.get)
            head = {k: statistics.median(paired_ratios(p, k)) for k, p in dec.head_to_head.items()}
            rows.append({"shape": name, "tokens": tokens, "kernel": dec.kernel, "best_among_all": best,
                         "ratio_among_all": among[best], "head_to_head": head})
            h = ", ".join(f"{k} {v:.2f}x alone" for k, v in head.items()) or "no head-to-head"
            print(f"{name:<14} {tokens:>4} tok: {dec.kernel:<22} (best among all: {best} {among[best]:.2f}x; {h})",
                  flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
