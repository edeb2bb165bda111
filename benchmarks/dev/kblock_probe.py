"""Would K-blocking help ``down`` (4096×11008) at 2-4 tokens? (docs/results/cpu24-notes.md §20)

At 4 tokens its activations (4 × 11008 × 2 bytes = 88 KB) do not fit L1, so the gather path takes four rows a
block. Probe without changing the kernel: the weight compressed in K-chunks whose activations fit L1 (each chunk
a 2:4 layer of its own, so the kernel takes one row a block with its 8 KB prefetch), the chunks' products summed,
against the one call on the whole weight. Weights cycled past L3, the two forms interleaved over rounds.

    python benchmarks/dev/kblock_probe.py --tokens 4 --chunks 4 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24.timing import l3_bytes, random_24_weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu24.load_extension()
    o, i = 4096, 11008
    w = random_24_weight(o, i, torch.bfloat16, "cpu")
    x = torch.randn(args.tokens, i, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = x.double() @ w.double().t()
    kc = i // args.chunks
    assert kc % 64 == 0, f"chunk of {kc} inputs: not a multiple of 64"
    whole = cpu24.compress(w)
    parts = [cpu24.compress(w[:, c * kc:(c + 1) * kc].contiguous()) for c in range(args.chunks)]
    xs = [x[:, c * kc:(c + 1) * kc].contiguous() for c in range(args.chunks)]

    def one(s):
        return ops.sparse24_mm(x, s["values"], s["meta"], None, None, 0)

    def chunked(ps):
        y = None
        for xc, p in zip(xs, ps):
            part = ops.sparse24_mm(xc, p["values"], p["meta"], None, None, 0).float()
            y = part if y is None else y.add_(part)
        return y

    for name, fn, held in (("whole", one, whole), ("chunked", chunked, parts)):
        err = float((fn(held).double() - ref).abs().max() / ref.abs().max())
        assert err < 0.02, (name, err)
    nbytes = sum(t.numel() * t.element_size() for t in whole.values())
    copies = max(2, -(-2 * l3_bytes() // nbytes))
    forms = {"whole": (one, [whole] + [{k: t.clone() for k, t in whole.items()} for _ in range(copies - 1)]),
             "chunked": (chunked, [parts] + [[{k: t.clone() for k, t in p.items()} for p in parts]
                                             for _ in range(copies - 1)])}
    times = {k: [] for k in forms}
    for _ in range(args.rounds):
        for k, (fn, cs) in forms.items():
            for c in cs[:1]:
                fn(c)
            t0 = time.perf_counter()
            for _ in range(3):
                for c in cs:
                    fn(c)
            times[k].append((time.perf_counter() - t0) / (3 * len(cs)) * 1e3)
    print(json.dumps({"tokens": args.tokens, "chunks": args.chunks, "threads": args.threads,
                      **{f"{k}_ms": [round(t, 3) for t in v] for k, v in times.items()},
                      "median_ratio": round(statistics.median(times["whole"]) / statistics.median(times["chunked"]), 3)}))


if __name__ == "__main__":
    main()
