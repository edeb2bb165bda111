"""Would K-blocking help ``down`` (4096×11008) at 2-4 tokens? (docs/results/cpu24-notes.md §20)

At 4 tokens its activations (4 × 11008 × 2 bytes = 88 KB) do not fit L1, so the gather path takes four rows a
block. Probe without changing the kernel: the weight compressed in K-chunks whose activations fit L1 (each chunk
a 2:4 layer of its own, so the kernel takes one row a block with its 8 KB prefetch), the chunks' products summed,
against the one call on the whole weight. Weights cycled past L3, the two forms interleaved over rounds
(``cycles.cycled_many``, as the dispatcher times its candidates); medians printed.

    python benchmarks/dev/kblock_probe.py --tokens 4 --chunks 4 --threads 1
"""

from __future__ import annotations

import argparse
import json

import torch

from cast_llm.deploy.sparse24 import cpu as cpu24
from cast_llm.deploy.sparse24.cycles import cycled_many
from cast_llm.deploy.sparse24.timing import random_24_weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--path", default="avx512-bf16", choices=sorted(cpu24.PATHS), help="the 2:4 path timed")
    ap.add_argument("--shape", default="4096x11008", help="out x in")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu24.load_extension()
    o, i = (int(v) for v in args.shape.split("x"))
    isa, hp = cpu24.PATHS[args.path], cpu24.on_huge_pages  # laid out as a layer's (huge pages where allowed)
    w = random_24_weight(o, i, torch.bfloat16, "cpu")
    x = torch.randn(args.tokens, i, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref = x.double() @ w.double().t()
    kc = i // args.chunks
    assert kc % 64 == 0, f"chunk of {kc} inputs: not a multiple of 64"
    whole = {k: hp(t) for k, t in cpu24.compress(w).items()}
    parts = {}  # one state of tensors, so that the timing clones it like any compressed weight
    for c in range(args.chunks):
        p = cpu24.compress(w[:, c * kc:(c + 1) * kc].contiguous())
        parts[f"values{c}"], parts[f"meta{c}"] = hp(p["values"]), hp(p["meta"])
    xs = [x[:, c * kc:(c + 1) * kc].contiguous() for c in range(args.chunks)]

    def one(s):
        return ops.sparse24_mm(x, s["values"], s["meta"], None, None, isa)

    def chunked(s):
        y = None
        for c, xc in enumerate(xs):
            part = ops.sparse24_mm(xc, s[f"values{c}"], s[f"meta{c}"], None, None, isa).float()
            y = part if y is None else y.add_(part)
        return y

    for name, fn, held in (("whole", one, whole), ("chunked", chunked, parts)):
        err = float((fn(held).double() - ref).abs().max() / ref.abs().max())
        assert err < 0.02, (name, err)
    # the dispatcher's paired timing: both forms interleaved over rounds, each over copies past the last-level cache
    t_whole, t_chunked = cycled_many([(one, whole, hp), (chunked, parts, hp)], repeats=args.rounds)
    print(json.dumps({"path": args.path, "shape": args.shape, "tokens": args.tokens, "chunks": args.chunks, "threads": args.threads,
                      "whole_ms": round(t_whole * 1e3, 3), "chunked_ms": round(t_chunked * 1e3, 3),
                      "median_ratio": round(t_whole / t_chunked, 3)}))

if __name__ == "__main__":
    main()
