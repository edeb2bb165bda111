"""2:4 GEMM vs dense, per linear shape of LLaMA-7B and SmolLM2-135M, at decode and prefill token counts.

For every distinct block-linear shape (``out × in``) and token count (decode: 1, 8, 32; prefill: 2,048 and
4,096 rows), side by side on one GPU, on random exactly-2:4 bf16 weights:

* ``dense`` — ``F.linear``;
* ``cusparselt`` — torch's ``_cslt_sparse_mm`` with the algorithm searched once (plan built per call);
* ``cusparselt-direct`` — cuSPARSELt with the plan built once (cast_llm.deploy.sparse24.cusparselt_direct);
* ``cutlass`` — torch's CUTLASS ops (Ampere only: reported as skipped with torch's reason elsewhere);
* ``dispatched`` — a ``Sparse24Linear`` with its measured dense/2:4 choice for that token count;

each timed ``eager`` (back-to-back calls: host cost included) and ``graph`` (replay of a captured CUDA graph:
GPU time only), every 2:4 output checked against ``F.linear`` (max|Δ|/max|y|).

Target key: ``linear24_prefill_speedup`` = the smallest, over the three LLaMA-7B shapes at 4,096 tokens, of
dense time / fastest 2:4 kernel time, graph-mode timings (the kernels' speed, not the host's; the eager rows
show what the host adds). ``--tiny`` runs tiny shapes on the CPU in seconds: dense only, every 2:4 kernel
reported as skipped with the reason, the target null.

    python benchmarks/linear24.py --json docs/results/gpu/linear24.json
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from _common import machine
from _sparse24 import command, identity, linear_shapes, write_json

from cast_llm.deploy.sparse24 import Dispatcher, Sparse24Linear, available_kernels
from cast_llm.deploy.sparse24.kernels import GPU_KERNELS
from cast_llm.deploy.sparse24.timing import gemm_fn, random_24_weight, rel_err, time_call

TOKENS = {"decode": (1, 8, 32), "prefill": (2048, 4096)}
KEY_TOKENS = 4096


def bench(models, tokens, dtype, device, modes, kernels, dispatcher):
    rows = []
    for model in models:
        for (out_f, in_f), layers in linear_shapes(model).items():
            weight = random_24_weight(out_f, in_f, dtype, device)
            lin = torch.nn.Linear(in_f, out_f, bias=False, device=device, dtype=dtype).requires_grad_(False)
            lin.weight.copy_(weight)
            layer = Sparse24Linear.from_linear(lin, kernels=kernels, dispatcher=dispatcher) if kernels else None
            for regime, counts in tokens.items():
                for n in counts:
                    gen = torch.Generator(device=device).manual_seed(n)
                    x = torch.randn(n, in_f, generator=gen, device=device).to(dtype)
                    ref = F.linear(x, weight)
                    for mode in modes:
                        row = {"model": model, "layers": layers, "out": out_f, "in": in_f, "regime": regime,
                               "tokens": n, "mode": mode, "kernels": {}}
                        row["dense_us"] = time_call(gemm_fn("dense", weight, x), mode=mode, device=device) * 1e6
                        for k in kernels:
                            if (k, mode) == ("cusparselt", "graph") and "cusparselt-direct" in kernels:
                                continue  # timed last (late_torch_op_in_graphs): a failed capture could poison the rest
                            try:
                                fn = gemm_fn(k, weight, x)
                                err = rel_err(fn(), ref)
                                us = time_call(fn, mode=mode, device=device) * 1e6
                                row["kernels"][k] = {"us": us, "speedup": row["dense_us"] / us, "rel_err": err}
                            except Exception as e:  # noqa: BLE001 - one kernel failing is a result, not a crash
                                row["kernels"][k] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                        if layer is not None:
                            chosen = layer.kernel_for(n, mode)
                            us = time_call(lambda: layer(x), mode=mode, device=device) * 1e6  # noqa: B023
                            row["dispatched"] = {"kernel": chosen, "us": us, "speedup": row["dense_us"] / us}
                        rows.append(row)
    return rows


def late_torch_op_in_graphs(rows, dtype, device):
    """torch's cuSPARSELt op inside a CUDA graph, timed after everything else: it builds a cuSPARSELt plan on
    every call, and if that ever fails during a capture the allocator may stay mid-capture for this process.
    Shows that the op's per-call cost is host time (in a graph it should match the direct binding)."""
    for r in rows:
        if r["mode"] != "graph" or "cusparselt-direct" not in r["kernels"]:
            continue
        weight = random_24_weight(r["out"], r["in"], dtype, device)
        gen = torch.Generator(device=device).manual_seed(r["tokens"])
        x = torch.randn(r["tokens"], r["in"], generator=gen, device=device).to(dtype)
        try:
            fn = gemm_fn("cusparselt", weight, x)
            us = time_call(fn, mode="graph", device=device,
                           validate=lambda y: None if rel_err(y, F.linear(x, weight)) <= 0.02 else "wrong") * 1e6  # noqa: B023
            r["kernels"]["cusparselt"] = {"us": us, "speedup": r["dense_us"] / us, "rel_err": rel_err(fn(), F.linear(x, weight))}
        except Exception as e:  # noqa: BLE001
            r["kernels"]["cusparselt"] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            break  # the process may be in a bad state now: stop here, the rows above are complete


def best_sparse(row):
    ok = [v for v in row["kernels"].values() if "us" in v and v["rel_err"] <= 0.02]
    return min(ok, key=lambda v: v["us"]) if ok else None


def report(rows, skipped):
    names = list(GPU_KERNELS) + sorted({k for r in rows for k in r["kernels"]} - set(GPU_KERNELS))
    print(f"{'model':<13} {'shape':>12} {'regime':<8} {'tok':>5} {'mode':<5} {'dense us':>9}  "
          + "  ".join(f"{k:>18}" for k in names) + f"  {'dispatched':>20}")
    for r in rows:
        cells = []
        for k in names:
            v = r["kernels"].get(k)
            cells.append(f"{'skipped':>18}" if v is None else f"{'failed':>18}" if "us" not in v
                         else f"{v['us']:>8.1f} {v['speedup']:>5.2f}x {v['rel_err']:.0e}"[-18:].rjust(18))
        d = r.get("dispatched")
        disp = f"{d['kernel'][:10]:>10} {d['speedup']:>5.2f}x" if d else "skipped"
        print(f"{r['model']:<13} {r['out']:>5}x{r['in']:<6} {r['regime']:<8} {r['tokens']:>5} {r['mode']:<5} "
              f"{r['dense_us']:>9.1f}  " + "  ".join(cells) + f"  {disp:>20}")
    for k, why in skipped.items():
        print(f"  {k} skipped: {why}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results (targets, rows, device, versions) to this file")
    ap.add_argument("--tiny", "--quick", action="store_true", help="tiny shapes on the CPU in seconds")
    ap.add_argument("--emulate", action="store_true",
                    help="a dry run of the GPU path's logic on the CPU: --tiny shapes with the emulated 2:4 kernel "
                         "(no figure means anything; target null)")
    ap.add_argument("--models", default="llama-7b,smollm2-135m", help="comma-separated shapes (see _sparse24.py)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.tiny or args.emulate:
        device, models, tokens = torch.device("cpu"), ["tiny-llama"], {"decode": (1, 8), "prefill": (64,)}
    else:
        if not torch.cuda.is_available():
            raise SystemExit("linear24.py needs a CUDA GPU (use --tiny for the CPU dry run)")
        device, models, tokens = torch.device("cuda"), args.models.split(","), TOKENS
        from cast_llm.deploy.sparse24 import cusparselt_direct

        cusparselt_direct.start_probe(device)
    kernels, skipped = available_kernels(device, dtype)
    if args.emulate:
        kernels = ["emulated"]
    modes = ("eager", "graph") if device.type == "cuda" else ("eager",)
    if device.type != "cuda":
        skipped["graph mode"] = "CUDA graphs need a CUDA device"
    dispatcher = Dispatcher(device=device) if kernels else None
    with torch.inference_mode():
        rows = bench(models, tokens, dtype, device, modes, kernels, dispatcher)
        if "graph" in modes and {"cusparselt", "cusparselt-direct"} <= set(kernels):
            late_torch_op_in_graphs(rows, dtype, device)
    key_rows = [r for r in rows if r["model"] == "llama-7b" and r["tokens"] == KEY_TOKENS and r["mode"] == "graph"]
    ratios = [r["dense_us"] / b["us"] for r in key_rows if (b := best_sparse(r))]
    target = min(ratios) if ratios and len(ratios) == len(key_rows) else None
    report(rows, skipped)
    print(f"linear24_prefill_speedup (min over LLaMA-7B shapes at {KEY_TOKENS} tokens, graph mode): "
          f"{'n/a' if target is None else f'{target:.3f}'}   [{time.perf_counter() - t0:.0f} s]")
    print(f"machine: {machine()}")
    write_json(args.json, {
        "linear24_prefill_speedup": target if target is None or math.isfinite(target) else None,
        "definition": (f"min over the LLaMA-7B block-linear shapes at {KEY_TOKENS} tokens of dense F.linear time / "
                       "fastest correct 2:4 kernel time, both timed as CUDA-graph replays (GPU time)"),
        "emulated": args.emulate, "rows": rows, "skipped": skipped, "identity": identity(device), "command": command(),
        "seconds": time.perf_counter() - t0,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
