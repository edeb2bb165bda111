"""Will the decay finish? A forecast of the sparse-weight ratio S_T an AdamS run will end with.

CAST's final prune ``W ← W ⊙ M`` is free only when AdamS has already driven the pruned weights to ~0, i.e.
when the sparse-weight ratio ``S_t = Σ‖W ⊙ M‖₁ / Σ‖W‖₁`` (method.md §7) has reached ~1. Whether it does
depends on the lr schedule, the number of steps, λ and the gradient noise in a way nobody can guess, so
the trainer forecasts it before and during training and says what would make it finish.

How (ours). AdamS's update of one pruned entry is a scalar recursion (Eq. 7-8): given its weight ``w``,
momentum ``μ`` and second moment ``v`` now, the lr schedule, α_t = t/T, λ and the gradients to come, it
is fully determined. The forecast runs exactly that recursion, vectorised, for a seeded sample of the
pruned entries of every target, from their current state (``w`` only before the first step), with the
gradients replaced by white Gaussian noise of the size AdamS has measured for that layer: the rms of the
pruned entries' momentum, ``σ_g = rms(μ)·sqrt((1+β1)/(1−β1))`` (the momentum of white noise of rms σ_g
has rms σ_g·sqrt((1−β1)/(1+β1))), or the rms of the first gradient before any step. The end magnitudes,
scaled up to each layer's number of pruned entries, give the pruned L1 mass the final prune will remove;
kept weights are taken as they are now, and the mask as fixed.

What it leaves out: a gradient that consistently pulls a pruned weight back (treated as noise of the same
size, so the forecast is optimistic where the loss resists the decay), and mask flips. The tests compare
it with the S_T that tiny runs reach (``tests/test_forecast.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cast_llm import dtensor

__all__ = ["DecayForecast", "LayerDecay", "decay_state", "forecast_decay", "forecast_from_layers",
           "l1_decay_knee", "l1_decay_to_finish", "simulate_pruned"]

# entry-steps per simulation: the sample shrinks for long runs so one forecast stays around a second; at most
# _SAMPLE entries in all (the spread of one pruned weight's end is wide, the sum over many is not)
_BUDGET = 6_000_000
_SAMPLE = 32_768
_MIN_PER_LAYER = 2


@dataclass
class LayerDecay:
    """One sparse weight's sample for the forecast: pruned entries' |w|, μ, v, and the gradient noise."""

    name: str
    w: torch.Tensor  # (k,) float64 sample of the pruned entries' weights
    mu: torch.Tensor  # (k,) their momentum μ (0 before the first step)
    v: torch.Tensor  # (k,) their second moment v (0 before the first step)
    pruned_count: int  # how many pruned entries the sample stands for
    kept_l1: float  # Σ |w| of the kept entries
    grad_rms: float  # σ_g: rms of the gradient noise of the pruned entries


@dataclass
class DecayForecast:
    """The forecast of :func:`forecast_decay`; ``sparse_weight_ratio`` is S_T, the quantity to watch."""

    step: int  # steps already done when the forecast was made
    total_steps: int
    sparse_weight_ratio_now: float
    sparse_weight_ratio: float  # forecast S_T
    pruned_l1_now: float
    pruned_l1_end: float  # forecast Σ|pruned w| at the end: what the final prune will remove
    kept_l1: float
    target: float
    suggestions: dict[str, float | None] = field(default_factory=dict)

    @property
    def finishes(self) -> bool:
        return self.sparse_weight_ratio >= self.target

    def as_dict(self) -> dict:
        return {"step": self.step, "total_steps": self.total_steps,
                "sparse_weight_ratio_now": self.sparse_weight_ratio_now,
                "sparse_weight_ratio": self.sparse_weight_ratio, "pruned_l1_now": self.pruned_l1_now,
                "pruned_l1_end": self.pruned_l1_end, "kept_l1": self.kept_l1, "target": self.target,
                "finishes": self.finishes, "suggestions": dict(self.suggestions)}

    def message(self, *, lr: float, l1_decay: float) -> str:
        """One paragraph for the user: the forecast, and (when it will not finish) what would."""
        head = (f"decay forecast: sparse-weight ratio S_t {self.sparse_weight_ratio_now:.3f} now, "
                f"{self.sparse_weight_ratio:.3f} expected at step {self.total_steps} (target ≥ {self.target}): "
                f"the final prune would remove {1 - self.sparse_weight_ratio:.1%} of the target weights' L1 mass")
        if self.finishes:
            return head
        tips = []
        s = self.suggestions
        if s.get("lr_factor"):
            tips.append(f"--lr {lr * s['lr_factor']:.3g} (×{s['lr_factor']:.3g})")
        if s.get("total_steps"):
            tips.append(f"{int(s['total_steps'])} steps (×{s['total_steps'] / self.total_steps:.3g})")
        if s.get("l1_decay"):
            tips.append(f"--l1-decay {s['l1_decay']:.3g}")
        fix = ("; forecast to finish with " + " or ".join(tips)) if tips else ""
        return (f"warning: {head}{fix}. A large lr can also damage the model (docs/training.md, 'Budgets'); "
                "on a short budget prefer --warm-start, --repair-fraction and --final-prune compensated.")


def simulate_pruned(
    w: torch.Tensor,
    mu: torch.Tensor,
    v: torch.Tensor,
    grad_rms: torch.Tensor,
    lrs: Sequence[float] | torch.Tensor,
    *,
    start_step: int,
    total_steps: int,
    l1_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Run AdamS's update of pruned entries (Eq. 7-8, ``m = 0``) from state ``(w, μ, v)`` after
    ``start_step`` steps through ``lrs`` (γ for steps ``start_step + 1`` …), with gradients drawn as
    ``N(0, grad_rms²)`` per entry; returns the final weights. Everything float64, shapes ``(k,)``."""
    beta1, beta2 = betas
    w, mu, v = w.double().clone(), mu.double().clone(), v.double().clone()
    sig = torch.as_tensor(grad_rms, dtype=torch.float64).expand_as(w)
    noise = torch.empty_like(w)
    lam = float(l1_decay)
    for i, gamma in enumerate(torch.as_tensor(lrs, dtype=torch.float64).tolist()):
        t = start_step + i + 1
        alpha = min(t / total_steps, 1.0)
        noise.normal_(generator=generator)
        mu.mul_(beta1).add_(noise * sig, alpha=1 - beta1)  # μ_t from the (simulated) loss gradient only
        mt = mu * (1 - alpha) + torch.sign(w) * (alpha * lam)  # Eq. 7
        v.mul_(beta2).addcmul_(mt, mt, value=1 - beta2)
        denom = (v / (1 - beta2 ** t)).sqrt_().add_(eps)
        w.addcdiv_(mt, denom, value=-gamma / (1 - beta1 ** t))  # Eq. 8
    return w


def _ratio(pruned: float, kept: float) -> float:
    total = pruned + kept
    return kept / total if total > 0 else 1.0


def _resample(lrs: torch.Tensor, k: int) -> torch.Tensor:
    """The same schedule shape stretched to ``k`` steps (linear interpolation)."""
    if lrs.numel() == k:
        return lrs
    x = torch.linspace(0, lrs.numel() - 1, k, dtype=torch.float64)
    lo = x.floor().long().clamp(max=lrs.numel() - 1)
    hi = (lo + 1).clamp(max=lrs.numel() - 1)
    frac = x - lo
    return lrs[lo] * (1 - frac) + lrs[hi] * frac


def forecast_from_layers(
    layers: list[LayerDecay],
    lrs: Sequence[float] | torch.Tensor,
    *,
    step: int,
    total_steps: int,
    l1_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    target: float = 0.99,
    suggest: bool = True,
    seed: int = 0,
) -> DecayForecast:
    """The forecast from explicit per-layer samples; ``lrs`` is the WHOLE run's schedule γ_1 … γ_T."""
    full = torch.as_tensor(lrs, dtype=torch.float64).flatten()
    if full.numel() != total_steps:
        raise ValueError(f"lrs must hold the whole schedule ({total_steps} values), got {full.numel()}")
    empty = torch.zeros(0, dtype=torch.float64)
    w = torch.cat([empty] + [x.w.double() for x in layers])
    mu = torch.cat([empty] + [x.mu.double() for x in layers])
    v = torch.cat([empty] + [x.v.double() for x in layers])
    sig = torch.cat([empty] + [torch.full((x.w.numel(),), x.grad_rms, dtype=torch.float64) for x in layers])
    # how many pruned entries each sampled one stands for
    weight = torch.cat([empty] + [torch.full((x.w.numel(),), x.pruned_count / max(1, x.w.numel()),
                                             dtype=torch.float64) for x in layers])
    kept = sum(x.kept_l1 for x in layers)
    pruned_now = float((w.abs() * weight).sum())

    def run(sched: torch.Tensor, total: int, lam: float, at: int) -> float:
        gen = torch.Generator().manual_seed(seed)
        end = simulate_pruned(w, mu, v, sig, sched[at:], start_step=at, total_steps=total, l1_decay=lam,
                              betas=betas, eps=eps, generator=gen)
        return float((end.abs() * weight).sum())

    pruned_end = run(full, total_steps, l1_decay, step)
    ratio = _ratio(pruned_end, kept)
    out = DecayForecast(step=step, total_steps=total_steps, sparse_weight_ratio_now=_ratio(pruned_now, kept),
                        sparse_weight_ratio=ratio, pruned_l1_now=pruned_now, pruned_l1_end=pruned_end,
                        kept_l1=kept, target=target)
    if suggest and ratio < target:
        def ok_lr(f):
            return _ratio(run(full * f, total_steps, l1_decay, step), kept) >= target

        def ok_lam(f):
            return _ratio(run(full, total_steps, l1_decay * f, step), kept) >= target

        out.suggestions = {"lr_factor": _bisect(ok_lr, 1.0, 100.0),
                           "l1_decay": _scaled(l1_decay, _bisect(ok_lam, 1.0, 1e3))}
        if step == 0:  # more steps with the same schedule shape (only meaningful before the run starts)
            def ok_steps(f):
                k = max(1, round(total_steps * f))
                return _ratio(run(_resample(full, k), k, l1_decay, 0), kept) >= target

            factor = _bisect(ok_steps, 1.0, 30.0)
            out.suggestions["total_steps"] = None if factor is None else math.ceil(total_steps * factor)
    return out


def _scaled(base: float, factor: float | None) -> float | None:
    return None if factor is None or base == 0 else base * factor


def _bisect(ok, lo: float, hi: float, rel: float = 1.1) -> float | None:
    """Smallest factor in [lo, hi] (geometric bisection to ``rel``) for which ``ok`` holds; None if hi fails."""
    if not ok(hi):
        return None
    while hi / lo > rel:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi




@torch.no_grad()
def decay_state(optimizer, *, remaining_steps: int, names: dict[int, str] | None = None,
                seed: int = 0) -> list[LayerDecay]:
    """Per sparse parameter of an :class:`~cast_llm.optim.AdamS`: a seeded sample of its pruned entries
    (weight, μ, v), its kept L1 mass and its gradient noise σ_g (see the module docstring). The sample
    size per layer shrinks with ``remaining_steps`` so that one forecast costs about the same at any T."""
    gen = torch.Generator().manual_seed(seed)
    sparse = [(gi, i, p, g) for gi, g in enumerate(optimizer.param_groups) if g.get("sparse")
              for i, p in enumerate(g["params"])]
    total = min(_SAMPLE, _BUDGET // max(1, remaining_steps))
    per_layer = max(_MIN_PER_LAYER, total // max(1, len(sparse)))
    layers = []
    for gi, i, p, group in sparse:
        beta1 = group["betas"][0]
        w = dtensor.local(p).detach()
        pruned = ~optimizer.mask(p)
        kept_l1 = float(w[~pruned].abs().double().sum())
        idx = pruned.flatten().nonzero().squeeze(1)
        count = idx.numel()
        if count > per_layer:
            idx = idx[torch.randperm(count, generator=gen)[:per_layer].to(idx.device)]
        state = optimizer.state.get(p, {})
        ws = w.flatten()[idx].double().cpu()
        if "exp_avg" in state and float(state["step"]) > 0:
            t = float(state["step"])
            mu_all = dtensor.local(state["exp_avg"]).flatten()
            mus = mu_all[idx].double().cpu()
            vs = dtensor.local(state["exp_avg_sq"]).flatten()[idx].double().cpu()
            rms_mu = float(mu_all[pruned.flatten()].double().square().mean().sqrt()) if count else 0.0
            grad_rms = rms_mu * math.sqrt((1 + beta1) / (1 - beta1)) / math.sqrt(max(1 - beta1 ** (2 * t), 1e-12))
        else:
            mus = torch.zeros_like(ws)
            vs = torch.zeros_like(ws)
            grad = p.grad
            grad_rms = (float(dtensor.local(grad).detach()[pruned].double().square().mean().sqrt())
                        if grad is not None and count else 0.0)
        name = (names or {}).get(id(p)) or _param_label(group, i, gi)
        layers.append(LayerDecay(name, ws, mus, vs, count, kept_l1, grad_rms))
    return layers


def _param_label(group, i: int, gi: int) -> str:
    names = group.get("param_names")
    return names[i] if names and i < len(names) else f"group{gi}.param{i}"


def forecast_decay(
    optimizer,
    lrs: Sequence[float] | torch.Tensor,
    *,
    target: float = 0.99,
    names: dict[int, str] | None = None,
    suggest: bool = True,
    seed: int = 0,
) -> DecayForecast:
    """Forecast the sparse-weight ratio S_T the :class:`~cast_llm.optim.AdamS` ``optimizer`` will end with.

    ``lrs`` is the whole run's lr schedule γ_1 … γ_T (``T`` = the optimizer's ``total_steps``); the
    forecast starts from the optimizer's current step. Call it before the first step (after a backward,
    so the gradient noise is known), or at any time during training. When the forecast S_T is below
    ``target``, ``suggestions`` holds the lr factor, λ and (before the run) the number of steps with which
    it would reach ``target`` (None where no value in the searched range — lr ×100, λ ×1000, steps ×30 —
    does). Deterministic for a given ``seed``.

    Example::

        lrs = [base_lr * scheduler.lr_lambdas[0](k) for k in range(T)]
        print(forecast_decay(opt, lrs).message(lr=base_lr, l1_decay=lam))
    """
    groups = [g for g in optimizer.param_groups if g.get("sparse")]
    if not groups:
        raise ValueError("forecast_decay: the optimizer has no sparse (N:M) param group")
    if any(g.get("decay_mode", "proportional") != "proportional" for g in groups):
        raise ValueError("forecast_decay: it models Eq. 7's proportional decay; the optimizer decays additively")
    if any(g.get("update", "adams") != "adams" for g in groups):
        raise ValueError("forecast_decay: it models Eq. 7's proportional decay; the optimizer takes Adam's update "
                         "(update='adam'), with no decay")
    g0 = groups[0]
    total = int(g0["total_steps"])
    steps = [float(optimizer.state[p]["step"]) for g in groups for p in g["params"]
             if "step" in optimizer.state.get(p, {})]
    step = int(max(steps)) if steps else 0
    layers = decay_state(optimizer, remaining_steps=max(1, total - step), names=names, seed=seed)
    return forecast_from_layers(layers, lrs, step=step, total_steps=total, l1_decay=float(g0["l1_decay"]),
                                betas=tuple(g0["betas"]), eps=float(g0["eps"]), target=target, suggest=suggest,
                                seed=seed)


def _l1_search(optimizer, lrs, *, target: float, seed: int):
    """(λ of the optimizer, S_T forecast at λ × f) for the λ searches below: the state sampled once."""
    groups = [g for g in optimizer.param_groups if g.get("sparse")]
    if not groups:
        raise ValueError("the optimizer has no sparse (N:M) param group")
    g0 = groups[0]
    total, lam = int(g0["total_steps"]), float(g0["l1_decay"])
    if lam <= 0:
        raise ValueError("the optimizer's λ is 0; give it a positive λ to search from")
    steps = [float(optimizer.state[p]["step"]) for g in groups for p in g["params"]
             if "step" in optimizer.state.get(p, {})]
    step = int(max(steps)) if steps else 0
    layers = decay_state(optimizer, remaining_steps=max(1, total - step), seed=seed)

    def ratio(f: float) -> float:
        return forecast_from_layers(layers, lrs, step=step, total_steps=total, l1_decay=lam * f,
                                    betas=tuple(g0["betas"]), eps=float(g0["eps"]), target=target, suggest=False,
                                    seed=seed).sparse_weight_ratio
    return lam, ratio


def l1_decay_knee(optimizer, lrs: Sequence[float] | torch.Tensor, *, share: float = 0.9, seed: int = 0,
                  span: float = 1e3) -> tuple[float, float, float]:
    """Where a larger λ stops helping: the smallest λ (to 10 %, from the optimizer's own) whose forecast S_T
    has gone ``share`` of the way from S_T at the optimizer's λ to S_T at ×``span``. AdamS's step on a pruned
    weight is at most ~γ_t however large λ is (its second moment grows with λ), so on a short run S_T has a
    ceiling below 1 that no λ passes: this λ is then the one the decay can use. Returns (λ, S_T at it, the
    ceiling: S_T at ×span)."""
    lam, ratio = _l1_search(optimizer, lrs, target=0.99, seed=seed)
    low, ceiling = ratio(1.0), ratio(span)
    aim = low + share * (ceiling - low)
    factor = _bisect(lambda f: ratio(f) >= aim, 1.0, span) or span
    return lam * factor, ratio(factor), ceiling


def l1_decay_to_finish(optimizer, lrs: Sequence[float] | torch.Tensor, *, target: float = 0.99, seed: int = 0,
                       span: float = 1e3) -> float | None:
    """The smallest λ (to 10 %) with which :func:`forecast_decay`'s S_T reaches ``target``, the rest of the run
    as it is: searched below the optimizer's own λ when that already finishes, above it when not (×1/span …
    ×span; the λ that :func:`forecast_decay`'s ``suggestions`` gives in the second case). None where even
    ×span does not finish. What a budget's λ grid is centred on (benchmarks/compare_methods.py)."""
    lam, ratio = _l1_search(optimizer, lrs, target=target, seed=seed)

    def ok(f: float) -> bool:
        return ratio(f) >= target

    factor = _bisect(ok, 1.0 / span, 1.0) if ok(1.0) else _bisect(ok, 1.0, span)
    return None if factor is None else lam * factor
