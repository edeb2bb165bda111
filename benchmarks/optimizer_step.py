"""Benchmark: one AdamS step vs one torch.optim.AdamW(foreach=True) step on SmolLM2-135M's parameter shapes.

Random fp32 weights and gradients with SmolLM2-135M's shapes (30 blocks of q/o 576x576, k/v 192x576,
gate/up 1536x576, down 576x1536 as 2:4 targets; RMSNorm vectors and the tied 49152x576 embedding as dense
parameters). All optimizers share the same parameters and gradients and are stepped in interleaved rounds
(AdamW, AdamS bool, AdamS packed, AdamW fused, ...), so a load change on a shared machine hits them alike.

Reported: the median step time of each, the ratios to AdamW(foreach), the median of an AdamS step that
also recomputes every mask (``t % mask_interval == 0``) and the amortised ratio over ``mask_interval``
steps, and the optimizer-state memory of each. ``--quick`` runs tiny shapes twice (a smoke test).

    python benchmarks/optimizer_step.py --threads 1
    python benchmarks/optimizer_step.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import machine

from cast_llm.optim.adams import AdamS


def smollm2_shapes(quick: bool) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(sparse target shapes, dense shapes) of SmolLM2-135M, or a tiny stand-in for ``--quick``."""
    if quick:
        layers, hidden, inter, kv, vocab = 2, 64, 128, 32, 256
    else:  # SmolLM2-135M: 30 layers, hidden 576, intermediate 1536, 9 heads / 3 kv heads of dim 64
        layers, hidden, inter, kv, vocab = 30, 576, 1536, 192, 49152
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),  # q, k, v, o
                 (inter, hidden), (inter, hidden), (hidden, inter)]  # gate, up, down
    sparse = per_layer * layers
    dense = [(vocab, hidden)] + [(hidden,)] * (2 * layers + 1)  # tied embedding, RMSNorms
    return sparse, dense


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


def bandwidth_lines(opts, times, sparse, dense) -> list[str]:
    """GPU: the bytes each optimizer must move per step (read θ, g, μ, v [+ mask]; write θ, μ, v) over its
    median time, against the device-to-device copy bandwidth measured here (issue 8: >= 80 %)."""
    buf = torch.empty(1 << 28, device=sparse[0].device)  # 1 GiB
    dst = torch.empty_like(buf)
    copies = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(buf)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - start)
    copy_bw = 2 * buf.numel() * buf.element_size() / statistics.median(copies)  # read + write
    del buf, dst
    elt = sparse[0].element_size()
    base = 7 * elt * sum(p.numel() for p in sparse + dense)
    mask = {"AdamS bool masks": 1.0, "AdamS packed masks": 0.125, "AdamS bool, fused=False": 1.0}
    out = ["", f"device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (1 GiB copy, read + write)"]
    for name in opts:
        moved = base + mask.get(name, 0.0) * sum(p.numel() for p in sparse)
        bw = moved / statistics.median(times[name])
        out.append(f"{name:<26} moves {moved / 1e9:.2f} GB/step: {bw / 1e9:>6.0f} GB/s = {bw / copy_bw:.0%} of copy")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 timed rounds: a smoke test")
    ap.add_argument("--steps", type=int, default=20, help="timed rounds (each steps every optimizer once)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (allocations, lazy state)")
    ap.add_argument("--mask-steps", type=int, default=5, help="timed rounds in which AdamS recomputes masks")
    ap.add_argument("--mask-interval", type=int, default=10, help="T1 of the amortised figure")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--device", default="cpu", help="cpu (the target of this benchmark) or cuda")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.mask_steps = 2, 1, 2
        # tiny tensors: a second thread only adds synchronisation (and stalls when a core is busy)
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    sparse_shapes, dense_shapes = smollm2_shapes(args.quick)
    g = torch.Generator(device=device).manual_seed(0)

    def make(shape: tuple[int, ...]) -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.randn(shape, generator=g, device=device) * 0.02)
        p.grad = torch.randn(shape, generator=g, device=device) * 1e-3
        return p

    sparse = [make(s) for s in sparse_shapes]
    dense = [make(s) for s in dense_shapes]
    numel = sum(p.numel() for p in sparse + dense)
    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def adams(storage: str, fused: bool | None = None) -> AdamS:
        groups = [{"params": sparse, "sparse": True}, {"params": dense}]
        return AdamS(groups, **hp, l1_decay=1e-6, total_steps=10**6, mask_interval=args.mask_interval,
                     foreach=True, fused=fused, mask_storage=storage)

    opts = {
        "AdamW(foreach=True)": torch.optim.AdamW(sparse + dense, **hp, foreach=True),
        "AdamS bool masks": adams("bool"),
        "AdamS packed masks": adams("packed"),
        "AdamW(fused=True)": torch.optim.AdamW(sparse + dense, **hp, fused=True),
    }
    if device.type == "cuda":  # the one-pass Triton kernel (fused=None picks it) against the foreach path
        opts["AdamS bool, fused=False"] = adams("bool", fused=False)
    times: dict[str, list[float]] = {name: [] for name in opts}
    mask_times: dict[str, list[float]] = {name: [] for name in opts}

    def round_(record: dict[str, list[float]] | None, mask_round: bool) -> None:
        for name, opt in opts.items():
            is_adams = isinstance(opt, AdamS)
            if is_adams:
                # t of the coming step; a mask-update step outside the mask rounds is left out of the medians
                t = int(opt.state[sparse[0]]["step"].item()) + 1 if sparse[0] in opt.state else 1
                for group in opt.param_groups:
                    group["mask_interval"] = 1 if mask_round else args.mask_interval
                updates_mask = mask_round or t == 1 or t % args.mask_interval == 0
            sync()
            start = time.perf_counter()
            opt.step()
            sync()
            elapsed = time.perf_counter() - start
            if record is not None and (not is_adams or updates_mask == mask_round):
                record[name].append(elapsed)

    for _ in range(args.warmup):
        round_(None, False)
    for _ in range(args.steps):
        round_(times, False)
    for _ in range(args.mask_steps):
        round_(mask_times, True)

    base = statistics.median(times["AdamW(foreach=True)"])
    base_mem, _ = state_bytes(opts["AdamW(foreach=True)"])
    lines = [
        f"machine: {machine()}",
        f"device: {device}; {'quick (tiny shapes)' if args.quick else 'SmolLM2-135M shapes'}: "
        f"{len(sparse)} sparse targets ({sum(p.numel() for p in sparse) / 1e6:.1f}M weights) + {len(dense)} dense "
        f"params ({sum(p.numel() for p in dense) / 1e6:.1f}M), {numel / 1e6:.1f}M in all, fp32",
        f"rounds: {args.warmup} warm-up, {args.steps} timed, {args.mask_steps} timed with a mask update; "
        f"mask_interval {args.mask_interval}",
        "",
        f"{'optimizer':<22} {'median step':>12} {'/ AdamW':>8} {'mask-update step':>17} {'/ AdamW':>8} "
        f"{'amortised':>10} {'state bytes':>14} {'masks':>12} {'/ AdamW':>8}",
    ]
    for name in opts:
        med = statistics.median(times[name])
        mem, mask_mem = state_bytes(opts[name])
        row = f"{name:<22} {med * 1e3:>9.1f} ms {med / base:>7.3f}x"
        if mask_times[name] and isinstance(opts[name], AdamS):
            mask_med = statistics.median(mask_times[name])
            amortised = ((args.mask_interval - 1) * med + mask_med) / args.mask_interval
            row += f" {mask_med * 1e3:>14.1f} ms {mask_med / base:>7.3f}x {amortised / base:>9.3f}x"
        else:
            row += f" {'':>17} {'':>8} {'':>10}"
        row += f" {mem:>14,d} {mask_mem:>12,d} {mem / base_mem:>7.3f}x"
        lines.append(row)
    if device.type == "cuda":
        lines += bandwidth_lines(opts, times, sparse, dense)
    lines.append("")
    lines.append("ratios are to the AdamW(foreach=True) median measured in the same interleaved rounds; "
                 "amortised = ((T1 - 1) x median + mask-update step) / T1")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
