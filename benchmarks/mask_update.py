"""Benchmark 2: recomputing every N:M mask (Eq. 6) vs one CAST training step, amortised over T1 steps.

AdamS recomputes the masks of all targets from ``|θ|`` every ``mask_interval`` (T1 = 10) steps. Each mask is
one vectorised ``nm_mask`` per weight: the 4 members of every group are ranked by 6 pairwise comparisons
(``cast_llm.sparsity.mask``) — no sort, of the tensor or of the groups. Timed in interleaved rounds with a
CAST w/o KD training step on the same model (the trainer's step, ``_common.py``):

* the mask update as AdamS does it (``nm_mask`` + storage; bool and packed);
* for reference, the same masks by ``topk(2)`` over the grouped ``(groups, 4)`` view and by ``argsort`` of
  the groups (a partial and a full sort of each group), on the same weights.

Target: mask update / step <= 1 % amortised over T1 = 10.

    python benchmarks/mask_update.py --threads 1
    python benchmarks/mask_update.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import (
    DTYPES,
    RANDOM_MODELS,
    build_variants,
    load,
    machine,
    random_batch,
    refresh_masks,
    sync,
    train_config,
    train_step,
)

from cast_llm.sparsity.mask import nm_mask


def topk_mask(w: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    groups = w.detach().abs().reshape(-1, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.topk(n, dim=1).indices, True)
    return keep.view(w.shape)


def argsort_mask(w: torch.Tensor, n: int = 2, m: int = 4) -> torch.Tensor:
    groups = w.detach().abs().reshape(-1, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.argsort(dim=1, descending=True)[:, :n], True)
    return keep.view(w.shape)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help=f"a model for load_model, or one of {list(RANDOM_MODELS)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                    help="of the training step: bf16 = autocast with fp32 master weights, as the trainer on a GPU")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mask-interval", type=int, default=10, help="T1")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny random LLaMA, 2 rounds: a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.batch, args.seq, args.rounds = "tiny-llama", 2, 32, 2
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    cfg = train_config(model=args.model)
    base = load(args.model, device)
    batch = random_batch(args.batch, args.seq, base.get_output_embeddings().weight.shape[0], device)
    dtype = DTYPES[args.dtype]
    autocast = dtype if dtype != torch.float32 else None
    variant = build_variants(base, cfg, ["cast_nokd"], dtype)["cast_nokd"]
    opt = variant.optimizer
    train_step(variant, batch, cfg, autocast)  # warm-up: lazy state, first masks
    targets = [p for g in opt.param_groups if g["sparse"] for p in g["params"]]
    numel = sum(p.numel() for p in targets)

    # CPU: the process's CPU time (the work, whatever the load of a shared machine); GPU: synchronised wall time
    clock = time.process_time if device.type == "cpu" else time.perf_counter

    def time_it(fn) -> float:
        sync(device)
        t0 = clock()
        fn()
        sync(device)
        return clock() - t0

    def encode_with(storage: str):
        def run():
            saved, opt.mask_storage = opt.mask_storage, storage
            try:
                refresh_masks(opt)
            finally:
                opt.mask_storage = saved
        return run

    cases = {
        "AdamS update, bool masks (nm_mask)": encode_with("bool"),
        "AdamS update, packed masks (nm_mask + pack)": encode_with("packed"),
        "nm_mask alone (6 pairwise comparisons)": lambda: [nm_mask(p.detach()) for p in targets],
        "topk(2) of the (groups, 4) view": lambda: [topk_mask(p) for p in targets],
        "argsort of the (groups, 4) view": lambda: [argsort_mask(p) for p in targets],
    }
    def kept_magnitude(mask, p):  # per group: the |w| a mask keeps (equal masks up to ties keep the same)
        return (p.detach().abs() * mask).reshape(-1, 4).sum(1)

    same = all(torch.equal(kept_magnitude(nm_mask(p.detach()), p), kept_magnitude(topk_mask(p), p))
               for p in targets[:3])
    times: dict[str, list[float]] = {name: [] for name in cases}
    steps: list[float] = []
    for _ in range(args.rounds):
        steps.append(time_it(lambda: train_step(variant, batch, cfg, autocast)))
        for name, fn in cases.items():
            times[name].append(time_it(fn))
        encode_with("bool")()  # leave AdamS with its own storage

    step = statistics.median(steps)
    lines = [
        f"machine: {machine()}",
        f"model {args.model}: {len(targets)} targets, {numel / 1e6:.1f}M target weights, on {args.device}; "
        f"CAST w/o KD step on {args.batch} x {args.seq} tokens ({args.dtype}); {args.rounds} interleaved rounds; "
        f"medians of {'CPU time (process_time)' if device.type == 'cpu' else 'wall time'}",
        "",
        f"{'mask computation (all targets)':<46}{'time':>10}{'/ step':>9}{'amortised /T1':>15}{'ns/weight':>11}",
    ]
    for name, ts in times.items():
        t = statistics.median(ts)
        lines.append(f"{name:<46}{t * 1e3:>8.1f}ms{100 * t / step:>8.2f}%{100 * t / step / args.mask_interval:>14.3f}%"
                     f"{t / numel * 1e9:>11.2f}")
    lines += [
        f"{'CAST w/o KD training step':<46}{step * 1e3:>8.0f}ms",
        "",
        f"amortised over T1 = {args.mask_interval}: the AdamS mask update costs "
        f"{100 * statistics.median(times['AdamS update, bool masks (nm_mask)']) / step / args.mask_interval:.3f}% "
        "of a step (target <= 1 %)",
        f"nm_mask and topk keep the same |w| in every group of the first 3 targets: {same} (they may keep "
        "different entries where |w| ties; nm_mask breaks ties towards the lower index)",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
