"""Benchmark 3: one whole training step — plain AdamW training vs CAST w/o KD vs CAST (method.md §7).

Same model, same batch, the trainer's own step (see ``_common.py``): the variants are stepped in
interleaved rounds (the order rotates every round), so load changes on a shared machine hit them alike.
Reported: the median of every phase and of the whole step per variant, and the ratios to plain training
(paper, GPT-2 on 8xH800: CAST w/o KD 1.045x, CAST 1.44x, theory for KD 4/3; targets 1.03x and 1.40x).
CAST's mask update (every ``mask_interval`` steps) is timed in the same rounds and added amortised.

    python benchmarks/train_step.py --threads 1                         # CPU: SmolLM2-135M, 1 x 256 tokens
    python benchmarks/train_step.py --device cuda --dtype bf16 --batch 8 --seq 1024
    python benchmarks/train_step.py --device cuda --dtype bf16 --model llama-1b --batch 4 --seq 2048
    python benchmarks/train_step.py --quick                             # tiny random LLaMA, a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from _common import (
    DTYPES,
    RANDOM_MODELS,
    Clock,
    build_variants,
    elapsed,
    load,
    machine,
    random_batch,
    refresh_masks,
    train_config,
    train_step,
)

ORDER = ["plain", "cast_nokd", "cast_kd"]
PHASES = ("forward", "backward", "clip", "optimizer")
LABELS = {"plain": "plain AdamW(fused)", "plain_foreach": "plain AdamW(foreach)", "cast_nokd": "CAST w/o KD",
          "cast_kd": "CAST (KD)"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help=f"a model for load_model, or one of {list(RANDOM_MODELS)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                    help="bf16: autocast with fp32 master weights, as the trainer on a GPU")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each steps every variant once)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (lazy state, first masks)")
    ap.add_argument("--mask-interval", type=int, default=10, help="T1 for the amortised mask update")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny random LLaMA, 2 rounds: a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.batch, args.seq, args.rounds, args.warmup = "tiny-llama", 2, 32, 2, 1
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    autocast = dtype if dtype != torch.float32 else None

    cfg = train_config(model=args.model)
    base = load(args.model, device)
    vocab = base.get_output_embeddings().weight.shape[0]
    batch = random_batch(args.batch, args.seq, vocab, device)
    variants = build_variants(base, cfg, ORDER, dtype)
    clock = Clock(device)
    times: dict[str, dict[str, list[tuple]]] = {name: {} for name in ORDER}
    mask_times: list[tuple] = []

    for r in range(args.warmup + args.rounds):
        order = ORDER[r % len(ORDER):] + ORDER[: r % len(ORDER)]  # rotate: no variant always runs first
        for name in order:
            phases = train_step(variants[name], batch, cfg, autocast)
            if r >= args.warmup:
                for k, t in phases.items():
                    times[name].setdefault(k, []).append(t)
        t0 = clock()
        refresh_masks(variants["cast_nokd"].optimizer)
        if r >= args.warmup:
            mask_times.append(elapsed(t0, clock()))

    n_params = sum(x.numel() for x in base.parameters())
    print(f"machine: {machine()}")
    print(f"model {args.model} ({n_params / 1e6:.1f}M parameters) on {args.device}, {args.dtype}"
          f"{' (autocast, fp32 master weights)' if args.dtype != 'fp32' else ''}; batch {args.batch} x "
          f"{args.seq} tokens; {args.warmup} warm-up + {len(mask_times)} timed interleaved rounds; medians")
    clocks = [("CPU time (process_time: the work, whatever the machine's load)", 1)] if device.type == "cpu" else []
    for title, i in clocks + [("wall time", 0)]:
        print()
        print(title)
        print(report(args, {n: {k: [t[i] for t in v] for k, v in ph.items()} for n, ph in times.items()},
                     [t[i] for t in mask_times]))
    return 0


def report(args, times, mask_times) -> str:
    """The table of phase medians and ratios for one clock (lists of seconds)."""
    med = {name: {k: statistics.median(v) for k, v in phases.items()} for name, phases in times.items()}
    rows = {name: {k: med[name][k] for k in PHASES} for name in ORDER}
    rows["plain_foreach"] = {**rows["plain"], "optimizer": med["plain"]["optimizer_extra"]}
    mask = statistics.median(mask_times)
    for name in ("cast_nokd", "cast_kd"):
        rows[name]["masks/T1"] = mask / args.mask_interval
    total = {name: sum(r.values()) for name, r in rows.items()}
    lines = [
        f"{'variant':<22}{'forward':>10}{'backward':>10}{'clip':>8}{'optimizer':>11}{'masks/T1':>10}"
        f"{'step':>10}{'/ plain':>9}{'/ plain(foreach)':>18}{'whole steps':>14}",
    ]
    for name in ("plain", "plain_foreach", "cast_nokd", "cast_kd"):
        r = rows[name]
        # the median of whole steps (without masks) as a check on the sum of phase medians
        source = times["plain" if name == "plain_foreach" else name]
        keys = [k if not (name == "plain_foreach" and k == "optimizer") else "optimizer_extra" for k in PHASES]
        whole = statistics.median(sum(source[k][i] for k in keys) for i in range(len(source["forward"])))
        lines.append(
            f"{LABELS[name]:<22}{r['forward'] * 1e3:>8.0f}ms{r['backward'] * 1e3:>8.0f}ms{r['clip'] * 1e3:>6.0f}ms"
            f"{r['optimizer'] * 1e3:>9.0f}ms{r.get('masks/T1', 0.0) * 1e3:>8.1f}ms{total[name] * 1e3:>8.0f}ms"
            f"{total[name] / total['plain']:>8.3f}x{total[name] / total['plain_foreach']:>17.3f}x"
            f"{whole * 1e3:>12.0f}ms"
        )
    lines += [
        f"step = sum of the phase medians + the mask update ({mask * 1e3:.1f} ms) / T1 = {args.mask_interval}; "
        "whole steps = median of whole steps, masks excluded",
        f"ratios: CAST w/o KD / plain {total['cast_nokd'] / total['plain']:.3f}x (target <= 1.03x, paper 1.045x); "
        f"CAST / plain {total['cast_kd'] / total['plain']:.3f}x (target <= 1.40x, paper 1.44x, theory 1.33x)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
