"""The table of docs/training.md ("Large models"): `cast-llm plan` for SmolLM2-135M, Llama-3.2-1B/3B,
Llama-3.1-8B and Llama-2-13B on 1, 2 and 8 GPUs of 80 GB, the paper's LLaMA recipe (global batch 256 ×
4096 tokens, 7,500 steps, KD, weight scaling; bf16: autocast, or under --fsdp its default mixed-precision
policy), one sequence per micro-batch.

    python benchmarks/plan_table.py            # prints the markdown table (seconds; no weights, no network)

Every figure is a prediction of cast_llm.plan (memory checked against measurement in
docs/results/plan-vs-measured.md); the times are the FLOP estimate at the stated MFU, not measurements.
"""

from __future__ import annotations

import sys

from cast_llm.plan import PlanOptions, model_shape, plan_run
from cast_llm.plan.report import duration
from cast_llm.plan.sizes import fmt_size
from cast_llm.train.config import PRESETS, TrainConfig

MODELS = ["smollm2-135m", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-2-13b"]
GPUS = [1, 2, 8]


def rows(models=MODELS, gpus=GPUS) -> list[str]:
    out = ["| model | GPUs | as launched (1 GPU: one process; more: DDP) | fits 80 GB? | what makes it fit | "
           "needs then (per GPU) | time, 7.9B tokens (estimate) |",
           "|---|---|---|---|---|---|---|"]
    for name in models:
        shape = model_shape(name)
        for g in gpus:
            run = TrainConfig(**{**PRESETS["llama"], "model": name, "batch_size": 1, "output_dir": "(planned)"})
            p = plan_run(run, PlanOptions(gpus=g, gpu_memory="80GB"), shape=shape)
            ok = p.memory.fits(p.capacity)
            if ok:
                fix, then, t = "—", "—", p.time
            elif p.fit.gpus == 0:
                fix, then, t = "nothing up to 4096 GPUs", "—", None
            else:
                fix = " ".join(p.fit.flags) + (f" (needs {p.fit.gpus} GPUs)" if p.fit.gpus else "")
                then, t = fmt_size(p.fit.plan.needed()), (p.fit_time or p.time)
            time_s = "—" if t is None else duration(t.seconds) + (f" on {p.fit.gpus}" if p.fit and p.fit.gpus else "")
            out.append(f"| {name} | {g} | {fmt_size(p.memory.needed())} | {'yes' if ok else 'no'} | {fix} | {then} | "
                       f"{time_s} |")
    return out


def main() -> int:
    print("\n".join(rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
