"""Benchmark: one AdamS step vs one torch AdamW step, on SmolLM2-135M's and on LLaMA-7B's parameter shapes.

Random fp32 weights and gradients with the models' shapes: the decoder's linear weights are the 2:4 targets
(one sparse param group), embeddings and RMSNorm vectors the dense group. AdamS rows are AdamS as built
here with ``nonfinite="ignore"`` — no gradient check, like AdamW — except "AdamS bool, checked" (the default
``nonfinite="raise"``: one more read of every gradient and one wait for the device per step).

* SmolLM2-135M (30 blocks of q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536; tied 49152x576
  embedding): every optimizer shares the same parameters and gradients and all are stepped in interleaved
  rounds (AdamW(foreach), AdamS bool, AdamS packed, AdamW(fused), ...), so a load change hits them alike.
  Reported: the median step, the ratios, the median of a step that also recomputes every mask and the
  amortised ratio over ``mask_interval`` steps, and the optimizer-state memory.
* LLaMA-7B (CUDA; hidden 4096, intermediate 11008, vocabulary 32000, untied head): fp32 parameters,
  gradients and states of all 32 layers need 110 GB, so the run takes as many layers as fit in the free
  device memory (about 21 on an 80 GB H100) and says how many. Optimizers run one after the other (each
  creates and frees its states), two rounds in alternating order.
* On CUDA: the device-to-device copy bandwidth, and for every row the bytes it must move per step (read θ,
  g, μ, v and the mask; write θ, μ, v) over its median time, as a fraction of that bandwidth.
* The candidates of the checked path ``adams.update`` (cast_llm.kernels), each on its own row: "AdamS bool,
  compiled" / "packed, compiled" (the update compiled by ``torch.compile``: inductor's C++ here, Triton on a
  GPU) and, on a CPU, "AdamS bool, blockwise" (the hand-written CPU path); "AdamS bool masks" takes whatever
  the automatic choice took (printed). The first step of every row — states, first masks, the kernels'
  checks and compiling — is timed apart and printed below the table (compile time is not in the medians).
  ``CAST_LLM_COMPILE=0`` leaves the compiled rows out.

``--json PATH`` writes the targets: ``adams_over_fused`` (LLaMA-7B shapes: AdamS bool masks / AdamW(fused)),
``adams_over_fused_smollm2``, ``adams_copy_fraction`` (LLaMA-7B shapes), with ``rows``, the device and the
versions. A CPU run leaves the targets null (they are GPU targets); its rows hold the CPU timings.

    python benchmarks/optimizer_step.py --threads 1                  # CPU, SmolLM2 shapes
    python benchmarks/optimizer_step.py --device cuda --json out.json  # < 1 min on an H100
    python benchmarks/optimizer_step.py --tiny --json out.json         # tiny shapes on CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import machine

from cast_llm import kernels
from cast_llm.optim.adams import AdamS

# (hidden, intermediate, k/v width, vocabulary, layers, tied embedding)
SHAPES = {
    "smollm2-135m": (576, 1536, 192, 49152, 30, True),
    "llama-7b": (4096, 11008, 4096, 32000, 32, False),
    "tiny": (64, 128, 32, 256, 2, True),
    "tiny-7b": (64, 176, 64, 256, 3, False),
}
HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
FUSED = "AdamW(fused=True)"
HEADLINE = "AdamS bool masks"
MASK_BYTES = {"AdamS bool masks": 1.0, "AdamS packed masks": 0.125, "AdamS bool, checked": 1.0,
              "AdamS bool, fused=False": 1.0, "AdamS bool, compiled": 1.0, "AdamS packed, compiled": 0.125,
              "AdamS bool, blockwise": 1.0, "AdamS packed, blockwise": 0.125}
# rows that run one candidate of the checked path adams.update (cast_llm.kernels) instead of the automatic choice
FORCED = {"AdamS bool, compiled": ("compiled",), "AdamS packed, compiled": ("compiled",),
          "AdamS bool, blockwise": ("blockwise",), "AdamS packed, blockwise": ("blockwise",)}


def model_shapes(name: str, layers: int | None = None) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(sparse target shapes, dense shapes) of a LLaMA-type decoder; ``layers`` overrides its depth."""
    hidden, inter, kv, vocab, n_layers, tied = SHAPES[name]
    n_layers = n_layers if layers is None else layers
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),  # q, k, v, o
                 (inter, hidden), (inter, hidden), (hidden, inter)]  # gate, up, down
    dense = [(vocab, hidden)] + ([] if tied else [(vocab, hidden)]) + [(hidden,)] * (2 * n_layers + 1)
    return per_layer * n_layers, dense


def make_params(shapes, device) -> list[torch.nn.Parameter]:
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, device=device).normal_(0.0, 0.02))
        p.grad = torch.empty(shape, device=device).normal_(0.0, 1e-3)
        out.append(p)
    return out


ONLY: list[str] = []  # --only: the rows to run (empty: all)


def make_optimizers(sparse, dense, device, mask_interval: int) -> dict:
    """name -> a function building that optimizer over ``sparse`` (2:4 targets) and ``dense``."""
    def adams(storage: str, fused: bool | None = None, nonfinite: str = "ignore", paths=None):
        groups = [{"params": sparse, "sparse": True}, {"params": dense}]

        def make():
            opt = AdamS(groups, **HP, l1_decay=1e-6, total_steps=10**6, mask_interval=mask_interval, fused=fused,
                        mask_storage=storage, nonfinite=nonfinite)
            opt.bench_paths = paths  # None: the automatic choice
            return opt
        return make

    makers = {
        "AdamW(foreach=True)": lambda: torch.optim.AdamW(sparse + dense, **HP, foreach=True),
        "AdamS bool masks": adams("bool"),
        "AdamS packed masks": adams("packed"),
        FUSED: lambda: torch.optim.AdamW(sparse + dense, **HP, fused=True),
        "AdamS bool, checked": adams("bool", nonfinite="raise"),
    }
    if device.type == "cuda":  # the reference path a CUDA user gets with fused=False (or without Triton)
        makers["AdamS bool, fused=False"] = adams("bool", fused=False)
    elif kernels.compile_enabled():  # the CPU's two candidates, each on its own (issue 29)
        makers["AdamS bool, blockwise"] = adams("bool", paths=FORCED["AdamS bool, blockwise"])
        makers["AdamS packed, blockwise"] = adams("packed", paths=FORCED["AdamS packed, blockwise"])
    if kernels.compile_enabled():
        makers["AdamS bool, compiled"] = adams("bool", paths=FORCED["AdamS bool, compiled"])
        makers["AdamS packed, compiled"] = adams("packed", paths=FORCED["AdamS packed, compiled"])
    if ONLY:
        makers = {k: v for k, v in makers.items() if k in ONLY or k == FUSED}
    return makers


def step(opt) -> None:
    """``opt.step()``, inside the restriction of its row (the compiled or the block-wise AdamS update)."""
    paths = getattr(opt, "bench_paths", None)
    if paths is None:
        opt.step()
        return
    with kernels.restricted("adams.update", paths):
        opt.step()


def update_path(opt) -> str | None:
    """Which candidate of adams.update this optimizer's sparse group runs (its row's, or the automatic choice)."""
    if not isinstance(opt, AdamS):
        return None
    paths = getattr(opt, "bench_paths", None)
    if paths:
        return paths[0]
    from cast_llm.optim.functional import update_variant

    p = opt.param_groups[0]["params"][0]
    variant = update_variant(p, opt.state[p]["exp_avg"], opt.mask_storage == "packed", "proportional", False, 0.0)
    return kernels.choose("adams.update", p.device, variant)


def compile_seconds(device) -> dict[str, float]:
    """Compiling the update (bool and packed masks), from a cold in-process cache: the time a run pays once.
    (inductor keeps its generated code on disk too: a machine that compiled it before pays less.)"""
    from cast_llm.optim import compiled_adams
    from cast_llm.sparsity.mask import pack_mask

    out = {}
    for storage in ("bool", "packed"):
        torch._dynamo.reset()
        compiled_adams.forget_compiled()
        p, g = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
        mu, v = torch.zeros_like(p), torch.zeros_like(p)
        mask = torch.rand(64, 64, device=device) > 0.5
        mask = pack_mask(mask) if storage == "packed" else mask
        sync(device)
        start = time.perf_counter()
        compiled_adams.compiled_adams_([p], [g], [mu], [v], [mask], [torch.zeros((), device=device)], beta1=0.9,
                                       beta2=0.999, lr=1e-4, eps=1e-8, l1_decay=1e-6, total_steps=10**6,
                                       weight_decay=0.0, maximize=False)
        sync(device)
        out[storage] = time.perf_counter() - start
    return out


def state_bytes(opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(all optimizer-state bytes, of which mask bytes)."""
    total = masks = 0
    for state in opt.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                total += value.numel() * value.element_size()
                if key == "mask":
                    masks += value.numel() * value.element_size()
    return total, masks


def bytes_moved(name: str, sparse, dense) -> float:
    """What an optimizer must move per step: read θ, g, μ, v (+ the mask), write θ, μ, v."""
    elt = sparse[0].element_size()
    n_sparse, n_dense = sum(p.numel() for p in sparse), sum(p.numel() for p in dense)
    return 7 * elt * (n_sparse + n_dense) + MASK_BYTES.get(name, 0.0) * n_sparse


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(opt, device) -> float:
    sync(device)
    start = time.perf_counter()
    step(opt)
    sync(device)
    return time.perf_counter() - start


def set_interval(opt, interval: int) -> None:
    if isinstance(opt, AdamS):
        for group in opt.param_groups:
            group["mask_interval"] = interval


def copy_bandwidth(device, gib: float) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 10 copies."""
    src = torch.empty(int(gib * (1 << 28)), device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return moved / statistics.median(times)


# ---------------------------------------------------------------------------------------- SmolLM2 shapes
def run_interleaved(label: str, sparse, dense, device, args) -> list[dict]:
    """Every optimizer alive at once, stepped in interleaved rounds; then rounds that recompute the masks."""
    makers = make_optimizers(sparse, dense, device, args.mask_interval)
    opts = {name: make() for name, make in makers.items()}
    times: dict[str, list[float]] = {name: [] for name in opts}
    mask_times: dict[str, list[float]] = {name: [] for name in opts}
    first: dict[str, float] = {}
    for name, opt in opts.items():  # the first step builds state, the first masks, checks and compiles: apart
        first[name] = timed_step(opt, device)
        set_interval(opt, 0)
    for r in range(args.warmup + args.steps):
        for name, opt in opts.items():
            elapsed = timed_step(opt, device)
            if r >= args.warmup:
                times[name].append(elapsed)
    for _ in range(args.mask_steps):
        for name, opt in opts.items():
            if isinstance(opt, AdamS):
                set_interval(opt, 1)
                mask_times[name].append(timed_step(opt, device))
                set_interval(opt, 0)
    rows = []
    for name, opt in opts.items():
        total, masks = state_bytes(opt)
        row = {"shapes": label, "optimizer": name, "median_ms": 1e3 * statistics.median(times[name]),
               "steps_timed": len(times[name]), "state_bytes": total, "mask_bytes": masks,
               "bytes_per_step": bytes_moved(name, sparse, dense), "first_step_s": first[name],
               "update_path": update_path(opt)}
        if mask_times[name]:
            row["mask_update_ms"] = 1e3 * statistics.median(mask_times[name])
        rows.append(row)
    del opts
    return rows


# ------------------------------------------------------------------------------------- LLaMA-7B shapes
def fitting_layers(device, requested: int | None) -> int:
    """How many LLaMA-7B layers fit: parameters, gradients and ONE optimizer's fp32 states, 18 bytes per
    sparse entry (8 + 8 + a bool mask, and the new masks of a refresh before the old ones are freed) and 16
    per dense one, leaving 3 GiB for the allocator and the kernels."""
    if requested is not None:
        return requested
    hidden, inter, _, vocab, full, _ = SHAPES["llama-7b"]
    per_layer = 18 * (4 * hidden * hidden + 3 * inter * hidden) + 16 * 2 * hidden
    fixed = 16 * (2 * vocab * hidden + hidden) + (3 << 30)
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(full, (free - fixed) // per_layer))


def run_phases(label: str, sparse, dense, device, args) -> list[dict]:
    """One optimizer at a time (each creates and frees its states), two rounds in alternating order."""
    makers = make_optimizers(sparse, dense, device, args.mask_interval)
    makers.pop("AdamW(foreach=True)")  # foreach keeps a full-size temporary per step: not what is compared
    makers.pop("AdamS bool, fused=False", None)  # the reference path: minutes at this size
    times: dict[str, list[float]] = {name: [] for name in makers}
    mask_times: dict[str, list[float]] = {name: [] for name in makers}
    mem: dict[str, tuple[int, int]] = {}
    order = list(makers)
    for r in range(2):
        for name in order if r == 0 else order[::-1]:
            opt = makers[name]()
            step(opt)  # states, first masks, checks and compiling: not timed
            set_interval(opt, 0)
            for i in range(args.warmup_7b + args.steps_7b):
                elapsed = timed_step(opt, device)
                if i >= args.warmup_7b:
                    times[name].append(elapsed)
            if isinstance(opt, AdamS):
                set_interval(opt, 1)
                mask_times[name].append(timed_step(opt, device))
            mem[name] = state_bytes(opt)
            del opt
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    rows = []
    for name in makers:
        row = {"shapes": label, "optimizer": name, "median_ms": 1e3 * statistics.median(times[name]),
               "steps_timed": len(times[name]), "state_bytes": mem[name][0], "mask_bytes": mem[name][1],
               "bytes_per_step": bytes_moved(name, sparse, dense)}
        if mask_times[name]:
            row["mask_update_ms"] = 1e3 * statistics.median(mask_times[name])
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- report
def finish_rows(rows: list[dict], copy_bw: float | None, mask_interval: int) -> None:
    """Ratios to AdamW(fused) of the same shapes, bandwidth, amortised mask cost."""
    fused = {r["shapes"]: r["median_ms"] for r in rows if r["optimizer"] == FUSED}
    for r in rows:
        r["over_fused"] = r["median_ms"] / fused[r["shapes"]]
        r["gb_s"] = r["bytes_per_step"] / (r["median_ms"] / 1e3) / 1e9
        r["copy_fraction"] = r["gb_s"] * 1e9 / copy_bw if copy_bw else None
        if "mask_update_ms" in r:
            amortised = ((mask_interval - 1) * r["median_ms"] + r["mask_update_ms"]) / mask_interval
            r["amortised_over_fused"] = amortised / fused[r["shapes"]]


def table(rows: list[dict], copy_bw: float | None) -> list[str]:
    lines = []
    for shapes in dict.fromkeys(r["shapes"] for r in rows):
        lines += ["", f"{shapes}:", f"{'optimizer':<26} {'median step':>12} {'/ fused':>8} {'mask-update step':>17} "
                  f"{'amortised':>10} {'state bytes':>15} {'masks':>13} {'GB/step':>8} {'GB/s':>6} {'of copy':>8}"]
        for r in (r for r in rows if r["shapes"] == shapes):
            mask = (f"{r['mask_update_ms']:>14.2f} ms {r['amortised_over_fused']:>9.3f}x" if "mask_update_ms" in r
                    else f"{'':>17} {'':>10}")
            frac = f"{r['copy_fraction']:>7.0%}" if r["copy_fraction"] is not None else f"{'-':>8}"
            lines.append(f"{r['optimizer']:<26} {r['median_ms']:>9.2f} ms {r['over_fused']:>7.3f}x {mask} "
                         f"{r['state_bytes']:>15,d} {r['mask_bytes']:>13,d} {r['bytes_per_step'] / 1e9:>8.2f} "
                         f"{r['gb_s']:>6.0f} {frac}")
    if copy_bw:
        lines += ["", f"device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)"]
    firsts = [r for r in rows if r.get("first_step_s") is not None]
    if firsts:
        lines += ["", "first step (states, first masks, the kernels' checks, compiling; not in the medians above):"]
        lines += [f"  {r['shapes']}: {r['optimizer']:<26} {r['first_step_s']:>7.2f} s   update path: "
                  f"{r.get('update_path') or '-'}" for r in firsts]
    return lines


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "triton": None}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # optional
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", "--quick", dest="tiny", action="store_true",
                    help="tiny stand-ins for both models, 2 timed rounds: a smoke test of seconds (CPU by default)")
    ap.add_argument("--steps", type=int, default=20, help="timed rounds on SmolLM2's shapes")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--mask-steps", type=int, default=5, help="timed rounds in which AdamS recomputes every mask")
    ap.add_argument("--mask-interval", type=int, default=10, help="T1 of the amortised figure")
    ap.add_argument("--steps-7b", type=int, default=8, help="timed steps per optimizer and round (LLaMA-7B)")
    ap.add_argument("--warmup-7b", type=int, default=2, help="untimed steps per optimizer and round (LLaMA-7B)")
    ap.add_argument("--layers", type=int, default=None, help="LLaMA-7B layers (default: as many as fit, <= 32)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", type=Path, default=None, help="write the targets, rows, device and versions here")
    ap.add_argument("--only", default=None,
                    help="the rows to run, separated by ';' (row names hold commas), e.g. 'AdamS bool masks;AdamS "
                         "bool, compiled'; AdamW(fused=True) is always kept (the ratios' base)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.steps, args.warmup, args.mask_steps, args.steps_7b, args.warmup_7b = 2, 1, 1, 2, 1
        args.threads = args.threads or 1  # tiny tensors: a second thread only adds synchronisation
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only:
        ONLY[:] = [x.strip() for x in args.only.split(";") if x.strip()]
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    started = time.perf_counter()

    copy_bw = copy_bandwidth(device, 0.01 if args.tiny else 2.0) if device.type == "cuda" else None
    compiling = compile_seconds(device) if kernels.compile_enabled() else {}
    small = "tiny" if args.tiny else "smollm2-135m"
    sparse, dense = (make_params(s, device) for s in model_shapes(small))
    rows = run_interleaved(small, sparse, dense, device, args)
    del sparse, dense
    layers = None
    if args.tiny or device.type == "cuda":  # a full 7B-shaped run does not fit a CPU box: GPU only
        big = "tiny-7b" if args.tiny else "llama-7b"
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # what SmolLM2's run and the copy buffers held, for fitting_layers
        layers = SHAPES[big][4] if args.tiny else fitting_layers(device, args.layers)
        for attempt in range(3):  # the memory estimate is an estimate: on OOM, retry with 3/4 of the layers
            try:
                sparse, dense = (make_params(s, device) for s in model_shapes(big, layers))
                rows += run_phases(big, sparse, dense, device, args)
                break
            except torch.cuda.OutOfMemoryError:
                if attempt == 2 or layers == 1:
                    raise
            # out of the except block, its traceback no longer holds the frames' tensors: free them all
            sparse = dense = None
            gc.collect()
            torch.cuda.empty_cache()
            layers = max(1, layers * 3 // 4)
            print(f"out of memory with LLaMA-7B shapes: retrying with {layers} layers", flush=True)
        del sparse, dense
    finish_rows(rows, copy_bw, args.mask_interval)

    def ratio(shapes: str, key: str = "over_fused"):
        return next((r[key] for r in rows if r["shapes"] == shapes and r["optimizer"] == HEADLINE), None)

    on_gpu = device.type == "cuda" and not args.tiny
    result = {
        "adams_over_fused": ratio("llama-7b") if on_gpu else None,
        "adams_over_fused_smollm2": ratio("smollm2-135m") if on_gpu else None,
        "adams_copy_fraction": ratio("llama-7b", "copy_fraction") if on_gpu else None,
        "headline_row": f"{HEADLINE} (nonfinite='ignore': AdamW(fused=True) checks no gradient either)",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({machine().split(';')[0]})",
        "versions": versions(),
        "copy_gb_s": copy_bw / 1e9 if copy_bw else None,
        "llama7b_layers": layers,
        "notes": ([] if on_gpu else ["not a GPU run: the targets are GPU targets and stay null; the rows hold "
                                     "this run's timings"])
        + ([f"LLaMA-7B shapes with {layers} of 32 layers: fp32 parameters, gradients and states of all 32 do "
            "not fit the device"] if on_gpu and layers and layers < 32 else []),
        "rows": rows,
        "compile_s": compiling,
        "command": "python benchmarks/optimizer_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "seconds": time.perf_counter() - started,
    }
    lines = [f"machine: {machine()}",
             f"device: {device}; AdamS rows: nonfinite='ignore' unless 'checked'; fp32 weights, gradients, states"]
    for shapes in dict.fromkeys(r["shapes"] for r in rows):
        sp, de = model_shapes(shapes, layers if shapes in ("llama-7b", "tiny-7b") else None)
        lines.append(f"{shapes}: {len(sp)} sparse targets ({sum(a * b for a, b in sp) / 1e6:.1f}M weights) + "
                     f"{len(de)} dense params" + (f", {layers} layers" if shapes in ("llama-7b", "tiny-7b") else ""))
    lines += table(rows, copy_bw)
    if compiling:
        lines.append("compiling the update (once per process and kind, apart from every time above): "
                     + ", ".join(f"{k} masks {v:.1f} s" for k, v in compiling.items()))
    lines += ["", "ratios are to AdamW(fused=True) of the same shapes, measured in the same run; amortised = "
              "((T1 - 1) x median + mask-update step) / T1 with T1 = " + str(args.mask_interval)]
    if on_gpu:
        lines.append(f"targets: adams_over_fused {result['adams_over_fused']:.3f} (<= 1.10), adams_over_fused_smollm2 "
                     f"{result['adams_over_fused_smollm2']:.3f} (<= 1.30), adams_copy_fraction "
                     f"{result['adams_copy_fraction']:.2f} (>= 0.70)")
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
