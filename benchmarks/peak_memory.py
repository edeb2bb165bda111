"""Benchmark 4: peak memory of a training step — plain AdamW training vs CAST w/o KD vs CAST (with teacher).

Each variant runs in its own process (a process's peak cannot be shared; on CPU forked after the imports,
which saves their seconds per variant): load the model, build the
variant (``_common.py``), one warm-up step (optimizer state and masks are allocated lazily), then reset the
peak and run two more steps. CPU: the peak resident set size over those steps (``VmHWM`` of
``/proc/self/status``, reset through ``/proc/self/clear_refs``; ``ru_maxrss`` where that is unavailable).
CUDA: ``torch.cuda.max_memory_allocated``. Also printed: the persistent tensors counted by size — weights,
optimizer state (of which N:M masks), teacher — so that peak minus persistent is what the step itself
allocates (activations, gradients, logits, KD work space).

    python benchmarks/peak_memory.py --threads 1
    python benchmarks/peak_memory.py --device cuda --dtype bf16 --batch 8 --seq 1024
    python benchmarks/peak_memory.py --quick
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
from _common import (
    DTYPES,
    RANDOM_MODELS,
    build_variants,
    load,
    machine,
    preload,
    random_batch,
    sync,
    train_config,
    train_step,
)

VARIANTS = ["plain", "cast_nokd", "cast_kd"]
LABELS = {"plain": "plain AdamW(fused)", "cast_nokd": "CAST w/o KD", "cast_kd": "CAST (KD)"}


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field))
    except (OSError, StopIteration):
        return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def child(args, name: str) -> dict:
    """Runs in a fresh forked process: the measurements of variant ``name``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    cfg = train_config(model=args.model)
    base = load(args.model, device)
    batch = random_batch(args.batch, args.seq, base.get_output_embeddings().weight.shape[0], device)
    v = build_variants(base, cfg, [name], dtype)[name]
    v.extra_optimizer = None  # the foreach AdamW row of train_step: never stepped, so never allocated
    autocast = dtype if dtype != torch.float32 else None
    train_step(v, batch, cfg, autocast)  # warm-up: optimizer state and masks now exist
    sync(device)
    state = [x for s in v.optimizer.state.values() for x in s.values()]
    masks = [s["mask"] for s in v.optimizer.state.values() if "mask" in s]
    out = {
        "weights": _tensor_bytes(v.model.parameters()),
        "optimizer_state": _tensor_bytes(state),
        "masks": _tensor_bytes(masks),
        "teacher": _tensor_bytes(v.teacher.parameters()) if v.teacher is not None else 0,
    }
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        out["before"] = torch.cuda.memory_allocated()
    else:
        out["reset"] = _reset_peak()
        out["before"] = (_rss_kib("VmRSS:") or 0) * 1024
    for _ in range(2):
        train_step(v, batch, cfg, autocast)
    sync(device)
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated()
    else:
        hwm = _rss_kib("VmHWM:") if out["reset"] else None
        out["peak"] = (hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help=f"a model for load_model, or one of {list(RANDOM_MODELS)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny random LLaMA: a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.batch, args.seq = "tiny-llama", 2, 32
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    # One process per variant, through an executor (not a bare Process) so that a child killed for memory
    # raises here. CPU: forked after the imports, before any tensor work (thread pools are not fork-safe
    # once started), so the children inherit the imports. CUDA cannot be forked at all: spawn.
    if args.device == "cpu":
        preload()
    context = multiprocessing.get_context("fork" if args.device == "cpu" else "spawn")
    results = {}
    for name in VARIANTS:
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            results[name] = pool.submit(child, args, name).result()

    mib = 2**20
    what = "peak allocated (CUDA)" if args.device.startswith("cuda") else "peak RSS"
    lines = [
        f"machine: {machine()}",
        f"model {args.model} on {args.device}, {args.dtype}; batch {args.batch} x {args.seq} tokens; "
        f"{what} over 2 steps after a warm-up step, one process per variant",
        "",
        f"{'variant':<20}{'peak':>11}{'/ plain':>9}{'weights':>11}{'opt. state':>12}{'of it masks':>13}"
        f"{'teacher':>10}{'step allocs':>13}",
    ]
    plain = results["plain"]["peak"]
    for name in VARIANTS:
        r = results[name]
        persistent = r["weights"] + r["optimizer_state"] + r["teacher"]
        lines.append(f"{LABELS[name]:<20}{r['peak'] / mib:>8.0f}MiB{r['peak'] / plain:>8.3f}x{r['weights'] / mib:>8.0f}MiB"
                     f"{r['optimizer_state'] / mib:>9.0f}MiB{r['masks'] / mib:>10.0f}MiB{r['teacher'] / mib:>7.0f}MiB"
                     f"{(r['peak'] - persistent) / mib:>10.0f}MiB")
    kd, nokd = results["cast_kd"], results["cast_nokd"]
    lines += [
        "",
        f"the teacher adds {(kd['peak'] - nokd['peak']) / mib:.0f} MiB to the peak "
        f"({kd['peak'] / nokd['peak']:.3f}x of CAST w/o KD; its weights: {kd['teacher'] / mib:.0f} MiB); "
        f"CAST w/o KD / plain: {nokd['peak'] / plain:.3f}x",
        "step allocs = peak - (weights + optimizer state + teacher); on CPU it also holds the interpreter, "
        "libraries and allocator slack",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
