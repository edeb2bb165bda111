"""Why does a 2:4 model whose every layer runs dense at 128 tokens prefill slower than its dense twin?
(cpu24-notes.md §55) SmolLM2-135M bf16 built as ``bench-inference`` builds it (magnitude 2:4, a deepcopy twin,
weights allocated alike, ``to_sparse24_`` with the dense copy kept, planned at 1 and 128 tokens, the careful head);
then 128-token prefills (head on the last position, as ``generate``) of the two in alternating order, each after
reading a 1 GB buffer (no model's weights left in a cache), and torch's profiler over one prefill of each.

    python benchmarks/dev/prefill_all_dense.py [pairs] [model] [kernel to leave out]

``model``: ``smollm2-135m`` (the default) or ``random:tinyllama-1.1b``; a kernel left out (e.g. ``cpu-amx-bf16``)
is not offered to the dispatcher (§56: does the 2:4 model lose its prefill on the layers given to it?).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

from cast_llm.deploy.bench import allocate_alike, keep_last_kwargs
from cast_llm.deploy.sparse24 import Dispatcher, plan_sparse24_, to_sparse24_
from cast_llm.deploy.sparse24.dense_cpu import use_careful_head_
from cast_llm.deploy.sparse24.kernels import available_kernels, default_kernels
from cast_llm.jobs.bench import random_model
from cast_llm.models import load_model
from cast_llm.prune.magnitude import magnitude_prune_
from cast_llm.targets import find_targets


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    name = sys.argv[2] if len(sys.argv) > 2 else "smollm2-135m"
    leave_out = sys.argv[3] if len(sys.argv) > 3 else None
    torch.set_num_threads(2)
    cpu = torch.device("cpu")
    if name.startswith("random:"):
        model = random_model(name.split(":", 1)[1], torch.bfloat16, cpu)
    else:
        model = load_model(name, dtype=torch.bfloat16, device=cpu)
    targets = find_targets(model, n=2, m=4, skip_incompatible=True)
    for t in targets:
        magnitude_prune_(t.weight.data.t() if t.transposed else t.weight.data, 2, 4)
    twin = copy.deepcopy(model)
    allocate_alike(model, twin, [t.fqn for t in targets])
    kernels, _ = available_kernels(cpu, torch.bfloat16, default_kernels(cpu))
    kernels = [k for k in kernels if k != leave_out]
    to_sparse24_(model, targets=targets, kernels=kernels, dispatch=Dispatcher(device="cpu"), skip_incompatible=True,
                 keep_dense=True)
    plan = plan_sparse24_(model, [1, 128], modes=("eager",), release=True)
    at128 = {}
    for chosen in plan.values():
        for case, k in chosen.items():
            if case.endswith(":128"):
                at128[k] = at128.get(k, 0) + 1
    print("layers per kernel at 128 tokens:", at128, "| head:", use_careful_head_(model), flush=True)
    print(f"{name}, left out: {leave_out}", flush=True)
    # (built outside inference mode, as bench-inference builds them: a deepcopy made inside it holds inference
    # tensors, whose head weight torch's matmul does not fold with the last position's strided input: it then copies
    # the whole head weight at every prefill, §55)
    compare(twin, model, pairs)


@torch.inference_mode()
def compare(twin, model, pairs: int) -> None:
    """The two models' 128-token prefills in ``pairs`` alternating pairs, each after a 1 GB read; then a profile of
    one prefill of each."""
    prompt = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    flush = torch.ones(1 << 28)  # 1 GB
    keep = keep_last_kwargs(model)

    def prefill(m) -> float:
        flush.sum()
        t0 = time.perf_counter()
        m(input_ids=prompt, use_cache=True, **keep)
        return time.perf_counter() - t0

    for m in (twin, model, twin, model):
        prefill(m)
    ratios, times = [], {"dense": [], "2:4": []}
    for r in range(pairs):
        order = [("dense", twin), ("2:4", model)] if r % 2 == 0 else [("2:4", model), ("dense", twin)]
        got = {name: prefill(m) for name, m in order}
        for k, v in got.items():
            times[k].append(v)
        ratios.append(got["dense"] / got["2:4"])
    print("prefill ms dense:", [round(x * 1e3, 1) for x in times["dense"]])
    print("prefill ms 2:4:  ", [round(x * 1e3, 1) for x in times["2:4"]])
    print(f"2:4 / dense per pair: {[round(x, 2) for x in ratios]}, median {statistics.median(ratios):.2f}", flush=True)
    for name, m in (("dense", twin), ("2:4", model)):
        flush.sum()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            m(input_ids=prompt, use_cache=True, **keep)
        print(f"== {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
