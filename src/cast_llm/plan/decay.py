"""Will the decay finish? The sparse-weight ratio S_T forecast before any weight is loaded.

The trainer's forecast (:mod:`cast_llm.optim.forecast`, method.md §10) runs AdamS's pruned-entry recursion
on the model's own weights and first gradient. Before the run neither exists, so this one takes the two
things it must know as stated assumptions — the rms of the target weights and the rms of a pruned entry's
gradient noise at the run's batch — and replaces the simulation by expectations over the lr schedule:

* the second moment AdamS sees is the EMA of ``E[μ̃_t²] = (1−α_t)² σ_μ² (1−β1^{2t}) + α_t² λ²`` with
  ``σ_μ² = σ_g² (1−β1)/(1+β1)`` (the momentum of white noise), bias-corrected: ``v̂_t``;
* the decay moves a pruned weight towards 0 by ``d_t = γ_t α_t λ / ((1−β1^t)(√v̂_t + ε))`` per step
  (Eq. 7-8 with the mask fixed), ``D = Σ d_t`` in all;
* the gradient noise spreads it as a random walk of variance ``Σ (γ_t (1−α_t) σ_g / (√v̂_t + ε))²``, mostly
  early (α small), before the decay does its work;
* so a pruned weight starting at ``w₀`` ends at ``E max(|w₀ + Z| − D, 0)``, ``Z ~ N(0, Σ…)``, plus the
  half-step it oscillates by around 0 at the end, ``d_T / 2``.

``w₀`` runs over the pruned entries of N:M groups of N(0, rms²) weights (a seeded sample; 0 with a warm
start, whose pruned weights start at exactly 0) and S_T = kept L1 / (kept + pruned L1). The test compares
it with the exact recursion (:func:`cast_llm.optim.forecast.simulate_pruned`) over schedules, λ, noise
levels and starting weights. It inherits that recursion's blind spot — a gradient that keeps pulling a
pruned weight back is treated as noise — and adds its own: the weight rms and the gradient noise are
guesses until the run measures them (the trainer's own forecast after the first backward replaces this one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DecayPlan", "decay_terms", "forecast_ratio", "plan_decay"]

_GAUSS = 48  # Gauss-Hermite nodes for the random walk's spread


@dataclass
class DecayPlan:
    """The forecast of :func:`plan_decay` (``ratio`` = S at the final prune) and what would fix it."""

    ratio: float
    target: float
    prune_step: int  # the optimizer step of the final prune (the start of a masked repair, or T)
    total_steps: int
    drift: float  # D = Σ d_t: how far the decay can move a pruned weight
    spread: float  # √Σ s_t²: the noise's random walk
    weight_rms: float
    grad_rms: float
    warm_start: bool
    max_grad_rms: float | None  # the largest gradient noise with which S reaches the target (None: never)
    lr_factor: float | None = None  # ×lr that reaches the target (None: none up to ×100)
    l1_factor: float | None = None  # ×λ that reaches the target (None: none up to ×1000)

    @property
    def finishes(self) -> bool:
        return self.ratio >= self.target

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"finishes": self.finishes}


def decay_terms(lrs: Sequence[float], *, total_steps: int, l1_decay: float, grad_rms: float,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, until: int | None = None
                ) -> tuple[float, float, float]:
    """``(D, spread², d_last)`` over optimizer steps 1 … ``until`` (default T) of the schedule ``lrs``."""
    b1, b2 = betas
    smu2 = grad_rms * grad_rms * (1 - b1) / (1 + b1)
    lam2 = l1_decay * l1_decay
    v = drift = spread2 = d = 0.0
    end = total_steps if until is None else until
    for i in range(end):
        t = i + 1
        a = min(t / total_steps, 1.0)
        v = b2 * v + (1 - b2) * ((1 - a) ** 2 * smu2 * (1 - b1 ** (2 * t)) + a * a * lam2)
        den = math.sqrt(v / (1 - b2 ** t)) + eps
        g = lrs[i]
        d = g * a * l1_decay / ((1 - b1 ** t) * den)
        drift += d
        spread2 += (g * (1 - a) * grad_rms / den) ** 2
    return drift, spread2, d


def _groups(n: int, m: int, rms: float, seed: int = 0, count: int = 4096):
    """(|w| of the pruned entries, mean kept L1 per group) of N:M groups of N(0, rms²) weights."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(count, m, generator=g, dtype=torch.float64).abs().mul_(rms).sort(dim=1).values
    return w[:, : m - n].flatten(), float(w[:, m - n:].sum(dim=1).mean())


def forecast_ratio(lrs: Sequence[float], *, total_steps: int, l1_decay: float, grad_rms: float, weight_rms: float,
                   warm_start: bool, until: int | None = None, n: int = 2, m: int = 4,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> tuple[float, float, float]:
    """``(S, D, spread)``: the sparse-weight ratio at step ``until`` (default T) of the module docstring."""
    import numpy as np
    import torch

    drift, spread2, d_last = decay_terms(lrs, total_steps=total_steps, l1_decay=l1_decay, grad_rms=grad_rms,
                                         betas=betas, eps=eps, until=until)
    pruned, kept = _groups(n, m, weight_rms)
    if warm_start:
        pruned = torch.zeros(1, dtype=torch.float64)
    x, wts = np.polynomial.hermite_e.hermegauss(_GAUSS)  # ∫ f(z) N(z; 0, 1) dz = Σ wts f(x) / √(2π)
    z = torch.as_tensor(x) * math.sqrt(spread2)
    wz = torch.as_tensor(wts) / math.sqrt(2 * math.pi)
    end = ((pruned[:, None] + z[None, :]).abs().sub_(drift).clamp_(min=0) * wz).sum(1).mean() + d_last / 2
    pruned_l1 = float(end) * (m - n)
    return kept / (kept + pruned_l1), drift, math.sqrt(spread2)


def _smallest(ok, lo: float, hi: float, rel: float = 1.1) -> float | None:
    """Smallest factor in [lo, hi] (geometric bisection) for which ``ok`` holds; None if ``hi`` fails."""
    if not ok(hi):
        return None
    if ok(lo):
        return lo
    while hi / lo > rel:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def plan_decay(lrs: Sequence[float], *, total_steps: int, l1_decay: float, grad_rms: float, weight_rms: float,
               warm_start: bool, prune_step: int | None = None, target: float = 0.99, n: int = 2, m: int = 4,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> DecayPlan:
    """The forecast at the final prune (``prune_step``: the first step of a masked repair; default T), the
    largest gradient noise that would still reach ``target``, and the lr / λ factors that would."""
    until = prune_step if prune_step is not None else total_steps

    def ratio(lr_f: float = 1.0, lam_f: float = 1.0, sig: float = grad_rms) -> float:
        sched = [g * lr_f for g in lrs] if lr_f != 1.0 else lrs
        return forecast_ratio(sched, total_steps=total_steps, l1_decay=l1_decay * lam_f, grad_rms=sig,
                              weight_rms=weight_rms, warm_start=warm_start, until=until, n=n, m=m, betas=betas,
                              eps=eps)[0]

    s, drift, spread = forecast_ratio(lrs, total_steps=total_steps, l1_decay=l1_decay, grad_rms=grad_rms,
                                      weight_rms=weight_rms, warm_start=warm_start, until=until, n=n, m=m,
                                      betas=betas, eps=eps)
    # the noise level at which it just finishes: σ_g / f for the smallest f ≥ 1e-3 that reaches the target
    if s >= target:
        grow = _smallest(lambda f: ratio(sig=grad_rms * f) < target, 1.0, 1e3)
        max_sig = None if grow is None else grad_rms * grow / 1.1
        max_sig = max_sig if max_sig is not None else float("inf")
    else:
        shrink = _smallest(lambda f: ratio(sig=grad_rms / f) >= target, 1.0, 1e3)
        max_sig = None if shrink is None else grad_rms / shrink
    out = DecayPlan(ratio=s, target=target, prune_step=until, total_steps=total_steps, drift=drift, spread=spread,
                    weight_rms=weight_rms, grad_rms=grad_rms, warm_start=warm_start, max_grad_rms=max_sig)
    if s < target:
        out.lr_factor = _smallest(lambda f: ratio(lr_f=f) >= target, 1.0, 100.0)
        out.l1_factor = _smallest(lambda f: ratio(lam_f=f) >= target, 1.0, 1000.0)
    return out
