"""How far AdamS moves a weight whose gradient is mostly noise, side by side with torch's Adam.

AdamS builds its second moment from the *momentum* (``v = EMA(μ~²)``, method.md §2), Adam from the raw
gradient (``v = EMA(g²)``). When the gradient of a weight is noise, the momentum averages much of it away,
so ``sqrt(v)`` is small and ``μ / sqrt(v)`` stays near 1: every weight moves by ~lr every step, where Adam
moves it by ~0.2 lr. That is the method, not a bug — but it means that at small batches (noisy gradients)
AdamS is effectively a ~3-4× larger lr than Adam at the same setting, and the lr that is safe for a
fine-tuning with Adam can wreck a pretrained model under AdamS. This benchmark measures the ratio on
synthetic gradients ``g = snr · s + N(0, 1)`` (``s`` a fixed random sign per weight) with λ = 0 (no decay:
only the update rule differs), for signal-to-noise ratios 0 (pure noise) to 1.

    python benchmarks/adams_noise.py
    python benchmarks/adams_noise.py --quick
"""

from __future__ import annotations

import argparse

import torch
from _common import machine

from cast_llm import AdamS


def drift(make_opt, *, steps: int, snr: float, shape=(256, 64), lr: float = 1e-3, seed: int = 0):
    """Mean |step| / lr over the last 3/4 of the steps, and mean |θ_T − θ_0| / lr."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = make_opt([p], lr)
    signal = torch.randn(shape, generator=gen, dtype=torch.float64).sign()
    prev = p.detach().clone()
    moves = []
    for _ in range(steps):
        p.grad = snr * signal + torch.randn(shape, generator=gen, dtype=torch.float64)
        opt.step()
        moves.append(float((p.detach() - prev).abs().mean()) / lr)
        prev = p.detach().clone()
    tail = moves[steps // 4:]
    return sum(tail) / len(tail), float(p.detach().abs().mean()) / lr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="40 steps")
    a = ap.parse_args(argv)
    steps = 40 if a.quick else a.steps
    torch.set_num_threads(1)
    print(f"machine: {machine()}")
    print(f"{steps} steps, lr 1e-3, β = (0.9, 0.999), λ = 0; g = snr·sign + N(0, 1); 256×64 weights, float64")
    print(f"{'snr':>5} | {'mean |step| / lr':>24} | {'|θ_T − θ_0| / lr':>24} | AdamS / Adam")
    print(f"{'':>5} | {'Adam':>11} {'AdamS':>12} | {'Adam':>11} {'AdamS':>12} | (displacement)")
    for snr in (0.0, 0.3, 1.0):
        adam = drift(lambda ps, lr: torch.optim.Adam(ps, lr=lr), steps=steps, snr=snr)
        adams = drift(lambda ps, lr: AdamS([{"params": ps, "sparse": True}], lr=lr, l1_decay=0.0,
                                           total_steps=steps), steps=steps, snr=snr)
        print(f"{snr:>5.1f} | {adam[0]:>11.2f} {adams[0]:>12.2f} | {adam[1]:>11.1f} {adams[1]:>12.1f} | "
              f"{adams[1] / adam[1]:.2f}×")
    print("AdamS moves noise-driven weights several times farther than Adam at the same lr: choose its lr lower.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
