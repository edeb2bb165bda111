"""Does the set of candidates timed beside dense move amx's ratio? (cpu24-notes.md §53) In one process, alternating:
dense against ``cpu-amx-bf16`` alone, and dense with every candidate a layer keeping its dense copy has (ten), at
128 tokens on TinyLlama's q/o and gate/up shapes; each timing's amx/dense ratio and its round ratios."""

from __future__ import annotations

import torch

from cast_llm.deploy.sparse24.dispatch import DENSE
from cast_llm.deploy.sparse24.kernels import CPU_KERNELS, available_kernels
from cast_llm.deploy.sparse24.timing import measure_gemms_rounds

torch.set_num_threads(2)
cpu, dt = torch.device("cpu"), torch.bfloat16
kernels, _ = available_kernels(cpu, dt, CPU_KERNELS)
ALL = [DENSE, "dense-careful", *(k for k in kernels if k != "cpu-unpack")]
for rep in range(3):
    for label, cands in (("two", [DENSE, "cpu-amx-bf16"]), ("ten", ALL)):
        for o, i in [(2048, 2048), (5632, 2048)]:
            got = measure_gemms_rounds(cands, o, i, dt, 128, "eager", cpu)
            d, a = got[DENSE], got["cpu-amx-bf16"]
            rr = [x / y for x, y in zip(d[2], a[2])]
            print(f"#{rep} {label} {o}x{i}: dense {d[0] * 1e6:.0f} us amx {a[0] * 1e6:.0f} us ratio {d[0] / a[0]:.2f} "
                  f"rounds {[round(x, 2) for x in rr]}", flush=True)
