"""Where does a decode step's time go? torch.profiler over greedy decode steps (after an unprofiled 128-token
prompt) of a model, dense (torch bf16) and 2:4 (dispatched for 1 token, the careful head where it is faster),
top operators by self CPU time and the linears by shape.

    python benchmarks/dev/decode_profile.py random:tinyllama-1.1b 16     # model (random:<shape> or a name), steps
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cast_llm.deploy.sparse24 import plan_sparse24_, to_sparse24_
from cast_llm.deploy.sparse24.dense_cpu import use_careful_head_
from cast_llm.jobs.bench import random_model
from cast_llm.models import load_model
from cast_llm.prune.magnitude import magnitude_prune_
from cast_llm.targets import find_targets


def steps(model, n, ctx=contextlib.nullcontext, prompt_len=128):
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    out = model(ids, use_cache=True)
    past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    with ctx() as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        dt = (time.perf_counter() - t0) / n
    return dt, prof


def pruned_bf16_model(spec: str):
    """(model in bf16 on the CPU, its 2:4 targets magnitude-pruned in place): ``random:<shape>`` or a name."""
    if spec.startswith("random:"):
        model = random_model(spec.split(":", 1)[1], torch.bfloat16, torch.device("cpu"))
    else:
        model = load_model(spec, dtype=torch.bfloat16, device=torch.device("cpu")).eval()
    targets = find_targets(model, n=2, m=4, skip_incompatible=True)
    with torch.no_grad():
        for t in targets:
            magnitude_prune_(t.weight.data, 2, 4)
    return model, targets


@torch.inference_mode()
def main():
    spec = sys.argv[1] if len(sys.argv) > 1 else "random:tinyllama-1.1b"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    torch.set_num_threads(2)
    model, targets = pruned_bf16_model(spec)
    for label in ("dense", "2:4"):
        if label == "2:4":
            to_sparse24_(model, targets=targets)
            plan = plan_sparse24_(model, [1], modes=("eager",), release=True)
            chosen = {}
            for c in plan.values():
                for v in c.values():
                    chosen[v] = chosen.get(v, 0) + 1
            print("2:4 choices at 1 token:", chosen)
            print(label, use_careful_head_(model))
        steps(model, 4)
        print(f"{label}: {steps(model, n)[0] * 1e3:.1f} ms/step unprofiled")
        s, prof = steps(model, n, lambda: profile(activities=[ProfilerActivity.CPU], record_shapes=True))
        print(f"{label}: {s * 1e3:.1f} ms/step profiled")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=40))
        rows = [e for e in prof.key_averages(group_by_input_shape=True)
                if e.key in ("aten::mm", "cast_llm_cpu24::sparse24_mm", "cast_llm_cpu24::dense_mm")]
        for e in sorted(rows, key=lambda e: -e.self_cpu_time_total):
            print(f"  {e.key:32s} {str(e.input_shapes)[:70]:70s} {e.count // n:4d}/step "
                  f"{e.self_cpu_time_total / e.count:8.1f} us  {e.self_cpu_time_total / n / 1e3:6.2f} ms/step")


if __name__ == "__main__":
    main()
