"""The token scaling law of method.md §7, the pure fit: how perplexity falls with the training tokens.

    L(D) = A + B / D^β,   L = ln(ppl),   D = training tokens in billions,   β = 0.2849 fixed (Chinchilla)

With β fixed the law is linear in ``x = D^−β``, so A (intercept) and B (slope) come from an ordinary
least-squares regression of L on x. From the fit:

- ``predict_ppl(D) = exp(A + B·D^−β)``; the asymptote ``exp(A)`` is the ppl an infinite budget reaches;
- ``tokens_to_reach(ppl*) = (B / (ln ppl* − A))^{1/β}`` billions, the paper's D* (with ppl* the dense
  model's ppl: the budget at which the sparse model is predicted to match it);
- ``leave_one_out()``: fit without the largest budget and predict it - an honest check of the extrapolation
  that D* relies on.

Not to be confused with the learnable *weight* scaling of Eq. 11-12 (:mod:`cast_llm.nn.scaled_linear`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["CHINCHILLA_BETA", "LeaveOneOut", "TokenScalingFit", "fit_token_scaling", "format_billions"]

CHINCHILLA_BETA = 0.2849


def _as_points(tokens_billions, ppl) -> tuple[np.ndarray, np.ndarray]:
    d = np.asarray(tokens_billions, dtype=np.float64).reshape(-1)
    p = np.asarray(ppl, dtype=np.float64).reshape(-1)
    if d.shape != p.shape:
        raise ValueError(
            f"tokens and ppl must have the same length, got {d.size} tokens and {p.size} ppl values"
        )
    for name, v in (("tokens", d), ("ppl", p)):
        if not np.all(np.isfinite(v)):
            raise ValueError(
                f"{name} contains NaN or infinity at position(s) {np.flatnonzero(~np.isfinite(v)).tolist()}"
            )
        if np.any(v <= 0):
            raise ValueError(f"{name} must be positive, got {v[v <= 0].tolist()[:5]}")
    return d, p


def _ols(d: np.ndarray, p: np.ndarray, beta: float) -> tuple[float, float, float]:
    """(A, B, R²) of ln p = A + B·d^−β by least squares; needs ≥ 2 distinct budgets."""
    x, y = d ** (-beta), np.log(p)
    xc, yc = x - x.mean(), y - y.mean()  # centred sums: exact recovery to ~1e-15 on noise-free data
    sxx = float(xc @ xc)
    if sxx <= 1e-300 or np.unique(d).size < 2:
        raise ValueError(
            f"need at least 2 distinct token budgets to fit the law, got {sorted(set(d.tolist()))}"
        )
    b = float(xc @ yc) / sxx
    a = float(y.mean() - b * x.mean())
    ss_res = float(np.sum((y - (a + b * x)) ** 2))
    ss_tot = float(yc @ yc)
    # all ppl equal: the fit (B = 0) is exact and explains everything there is
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return a, b, r2


@dataclass(frozen=True)
class LeaveOneOut:
    """The fit without the largest budget, and how well it predicts that budget's perplexity."""

    tokens_billions: float  # the held-out budget
    predicted_ppl: float
    actual_ppl: float
    relative_error: float  # (predicted − actual) / actual: positive = the law is pessimistic
    fit: TokenScalingFit

    def to_dict(self) -> dict:
        return {
            "tokens_billions": self.tokens_billions,
            "predicted_ppl": self.predicted_ppl,
            "actual_ppl": self.actual_ppl,
            "relative_error": self.relative_error,
            "A": self.fit.A,
            "B": self.fit.B,
        }


@dataclass(frozen=True)
class TokenScalingFit:
    """``ln ppl = A + B / D^β`` fitted to points (D in billions of tokens); see the module docstring."""

    A: float
    B: float
    beta: float
    r2: float
    n_points: int
    tokens_billions: tuple[float, ...] = field(repr=False)
    ppl: tuple[float, ...] = field(repr=False)

    @property
    def asymptote_ppl(self) -> float:
        """exp(A): the perplexity the law predicts for an unlimited budget."""
        return math.exp(self.A)

    def predict_ppl(self, tokens_billions):
        """exp(A + B·D^−β) for a scalar (-> float) or an array (-> ndarray) of budgets in billions."""
        d = np.asarray(tokens_billions, dtype=np.float64)
        if np.any(~np.isfinite(d)) or np.any(d <= 0):
            raise ValueError(f"tokens must be positive and finite, got {tokens_billions!r}")
        out = np.exp(self.A + self.B * d ** (-self.beta))
        return float(out) if out.ndim == 0 else out

    def tokens_to_reach(self, ppl: float) -> float | None:
        """D* = (B / (ln ppl − A))^{1/β} in billions of tokens: the budget at which the law reaches ``ppl``.

        None when the law never reaches it: the asymptote exp(A) is at or above ``ppl``, or B ≤ 0 (the fitted
        ppl does not fall with more tokens, so more tokens do not help by this law). A target above the
        current points gives a D* below the measured budgets, not None.
        """
        if not (isinstance(ppl, (int, float)) and math.isfinite(ppl) and ppl > 0):
            raise ValueError(f"target ppl must be a positive number, got {ppl!r}")
        gap = math.log(ppl) - self.A
        if self.B <= 0 or gap <= 0:
            return None
        log_d = (math.log(self.B) - math.log(gap)) / self.beta  # in logs: D* can be astronomically large
        return math.exp(log_d) if log_d < 700 else math.inf

    def leave_one_out(self) -> LeaveOneOut:
        """Refit without the largest budget and predict its ppl (method.md §7's leave-one-out check).

        When several points share the largest budget (repeated seeds) all of them are held out, so that the
        prediction is a true extrapolation; the actual value is then their geometric mean (the fit lives in
        log space). Needs 2 distinct budgets left.
        """
        d, p = np.asarray(self.tokens_billions), np.asarray(self.ppl)
        last = d.max()
        keep = d < last
        if np.unique(d[keep]).size < 2:
            raise ValueError("leave-one-out needs at least 2 distinct token budgets besides the largest one")
        fit = _fit(d[keep], p[keep], self.beta)
        actual = float(np.exp(np.log(p[~keep]).mean()))
        predicted = fit.predict_ppl(float(last))
        return LeaveOneOut(float(last), predicted, actual, (predicted - actual) / actual, fit)

    def to_dict(self) -> dict:
        return {
            "A": self.A,
            "B": self.B,
            "beta": self.beta,
            "r2": self.r2,
            "n_points": self.n_points,
            "asymptote_ppl": self.asymptote_ppl,
            "tokens_billions": list(self.tokens_billions),
            "ppl": list(self.ppl),
        }


def _fit(d: np.ndarray, p: np.ndarray, beta: float) -> TokenScalingFit:
    a, b, r2 = _ols(d, p, beta)
    return TokenScalingFit(a, b, beta, r2, int(d.size), tuple(map(float, d)), tuple(map(float, p)))


def fit_token_scaling(
    tokens_billions: Sequence[float], ppl: Sequence[float], beta: float = CHINCHILLA_BETA
) -> TokenScalingFit:
    """Fit ``ln ppl = A + B / D^β`` with β fixed (method.md §7) by least squares of ln ppl on D^−β.

    ``tokens_billions``: training tokens of each point in billions (20M tokens = 0.02). Refuses (ValueError)
    fewer than 3 points, mismatched lengths, NaN/inf, non-positive tokens or ppl, a single distinct budget,
    and β ≤ 0.
    """
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a positive number, got {beta!r}")
    d, p = _as_points(tokens_billions, ppl)
    if d.size < 3:
        raise ValueError(f"the token scaling law needs at least 3 points (budgets), got {d.size}")
    return _fit(d, p, float(beta))


def format_billions(d: float) -> str:
    """A budget in billions as a short count: 0.02 -> '20M', 1.5 -> '1.5B', 2500 -> '2.5T'."""
    if not math.isfinite(d):
        return "∞"
    n = d * 1e9
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"
