"""The whole-model check on a real plan (cpu24-notes.md §56): TinyLlama-1.1B's shape (random weights, magnitude 2:4,
bf16) swapped with its dense copies kept, under a dispatcher whose margin is ``min_speedup`` (1.0 here, so that
near-margin kernels are taken and there is a plan to check), planned at 1 and 128 tokens with
``plan_sparse24_(forward=...)``: what each layer's own timing chose, what the check measured and decided.

    python benchmarks/dev/model_check.py [min_speedup]
"""

from __future__ import annotations

import sys

import torch

from cast_llm.deploy.bench import cache_flusher, keep_last_kwargs
from cast_llm.deploy.sparse24 import Dispatcher, plan_sparse24_, to_sparse24_
from cast_llm.jobs.bench import random_model
from cast_llm.prune.magnitude import magnitude_prune_
from cast_llm.targets import find_targets


def main() -> None:
    margin = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    torch.set_num_threads(2)
    cpu = torch.device("cpu")
    model = random_model("tinyllama-1.1b", torch.bfloat16, cpu)
    targets = find_targets(model, n=2, m=4, skip_incompatible=True)
    for t in targets:
        magnitude_prune_(t.weight.data.t() if t.transposed else t.weight.data, 2, 4)
    to_sparse24_(model, targets=targets, dispatch=Dispatcher(device=cpu, min_speedup=margin), keep_dense=True)
    prompt = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    keep = keep_last_kwargs(model)
    before = {}
    for _, layer in [(n, m) for n, m in model.named_modules() if hasattr(m, "kernel_for")]:
        k = layer.kernel_for(128, "eager")
        before[k] = before.get(k, 0) + 1
    print(f"margin {margin}: the layers' own choices at 128 tokens: {before}", flush=True)
    checks = []
    plan_sparse24_(model, [1, 128], release=True, checks=checks,
                   forward=lambda n: model(input_ids=prompt[:, :n], use_cache=True, **keep),
                   flush=cache_flusher(cpu)[0])
    for c in checks:
        print(f"check at {c['tokens']} tokens: {c['layers']} layers moved off dense; dense / plan per pair "
              f"{[round(r, 3) for r in c['ratios']]}: {'reverted to dense' if c['reverted'] else 'plan kept'}",
              flush=True)


if __name__ == "__main__":
    main()
