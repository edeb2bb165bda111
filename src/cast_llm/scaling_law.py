"""The token scaling law of method.md §7: how perplexity falls with the number of training tokens.

    L(D) = A + B / D^β,   L = ln(ppl),   D = training tokens in billions,   β = 0.2849 fixed (Chinchilla)

With β fixed the law is linear in ``x = D^−β``, so A (intercept) and B (slope) come from an ordinary
least-squares regression of L on x. From the fit:

- ``predict_ppl(D) = exp(A + B·D^−β)``; the asymptote ``exp(A)`` is the ppl an infinite budget reaches;
- ``tokens_to_reach(ppl*) = (B / (ln ppl* − A))^{1/β}`` billions, the paper's D* (with ppl* the dense
  model's ppl: the budget at which the sparse model is predicted to match it);
- ``leave_one_out()``: fit without the largest budget and predict it - an honest check of the extrapolation
  that D* relies on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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


def plot_token_scaling(
    fit: TokenScalingFit,
    points=None,
    dense_ppl: float | None = None,
    *,
    path: str | Path,
    title: str | None = None,
) -> Path:
    """PNG of the points, the fitted curve, the dense ppl and D* (tokens on a log axis, in billions).

    ``points``: ``(tokens_billions, ppl)`` to draw (default: the points of the fit).
    """
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    d, p = (
        np.asarray(v, dtype=float) for v in (points if points is not None else (fit.tokens_billions, fit.ppl))
    )
    d_star = fit.tokens_to_reach(dense_ppl) if dense_ppl is not None else None
    lo, hi = d.min() / 1.5, d.max() * 2.0
    # extend the curve to D* when it is within 3 decades of the data; beyond that only the legend says it
    show_star = d_star is not None and d_star <= d.max() * 1e3
    if show_star:
        lo, hi = min(lo, d_star / 1.5), max(hi, d_star * 1.5)
    grid = np.geomspace(lo, hi, 200)

    fig = Figure(figsize=(7.0, 4.6), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    ax.plot(
        grid,
        fit.predict_ppl(grid),
        color="tab:blue",
        lw=2,
        label=f"fit: ln ppl = {fit.A:.3f} + {fit.B:.3f}·D^−{fit.beta:g}  (R² = {fit.r2:.4f})",
    )
    ax.scatter(d, p, color="tab:blue", edgecolor="black", zorder=3, s=36, label=f"measured ({d.size} runs)")
    ax.axhline(
        fit.asymptote_ppl, color="gray", ls=":", lw=1.2, label=f"asymptote exp(A) = {fit.asymptote_ppl:.3g}"
    )
    if dense_ppl is not None:
        ax.axhline(dense_ppl, color="tab:red", ls="--", lw=1.5, label=f"dense ppl = {dense_ppl:.3g}")
        if d_star is None:
            ax.plot([], [], " ", label="D*: not reachable by this fit")
        elif show_star:
            ax.axvline(d_star, color="tab:red", ls=":", lw=1.2)
            ax.scatter(
                [d_star],
                [dense_ppl],
                marker="*",
                s=160,
                color="tab:red",
                edgecolor="black",
                zorder=4,
                label=f"D* = {format_billions(d_star)} tokens",
            )
        else:
            ax.plot([], [], " ", label=f"D* = {format_billions(d_star)} tokens (off the chart)")
    ys = [*fit.predict_ppl(grid), *p, fit.asymptote_ppl] + ([dense_ppl] if dense_ppl is not None else [])
    _log_axes(ax, hi / lo, max(ys) / min(ys))
    ax.set_xlabel("training tokens D (billions, log scale)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title or "Token scaling law (method.md §7)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def _log_axes(ax, x_span: float, y_span: float) -> None:
    """Log axes with plain numbers (0.02, 30) instead of 2×10⁻²; fewer labelled minor ticks as the range
    (max/min) grows, so that labels never collide."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis, span in ((ax.xaxis, x_span), (ax.yaxis, y_span)):
        axis.set_major_formatter(plain)
        subs = (2.0, 3.0, 5.0) if span < 30 else (2.0, 5.0)
        axis.set_minor_locator(LogLocator(base=10, subs=subs))
        axis.set_minor_formatter(plain if span < 300 else NullFormatter())


def format_billions(d: float) -> str:
    """A budget in billions as a short count: 0.02 -> '20M', 1.5 -> '1.5B', 2500 -> '2.5T'."""
    if not math.isfinite(d):
        return "∞"
    n = d * 1e9
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"
