"""A fit with its checks: the leave-one-out prediction, the tokens to reach the dense perplexity, the plot."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from cast_llm.errors import CastError
from cast_llm.scaling.fit import (
    CHINCHILLA_BETA,
    LeaveOneOut,
    TokenScalingFit,
    fit_token_scaling,
    format_billions,
)
from cast_llm.scaling.plot import plot_token_scaling
from cast_llm.scaling.points import Point

__all__ = ["FitReport", "fit_report"]


@dataclass
class FitReport:
    """The fit of a set of points, with its leave-one-out check and the tokens to reach the dense ppl."""

    fit: TokenScalingFit
    points: list[Point]
    dense_ppl: float | None
    leave_one_out: LeaveOneOut | None
    leave_one_out_error: str | None  # why there is no leave-one-out check
    tokens_to_reach_dense: float | None  # D* in billions (inf: astronomically far); None: never
    plot: Path | None = None

    def to_dict(self) -> dict:
        d_star = self.tokens_to_reach_dense
        out = {
            "fit": self.fit.to_dict(),
            "leave_one_out": self.leave_one_out.to_dict() if self.leave_one_out else None,
            "leave_one_out_error": self.leave_one_out_error,
            "dense_ppl": self.dense_ppl,
            "dense_reachable": d_star is not None,
            "tokens_to_reach_dense_billions": None if d_star is None or math.isinf(d_star) else d_star,
            "points": [{"tokens_billions": p.tokens_billions, "ppl": p.ppl, "source": p.source} for p in self.points],
        }
        if self.plot is not None:
            out["plot"] = str(self.plot)
        return out

    def lines(self) -> list[str]:
        """The report as text: the law, the points against the fit, A, B, R², the checks and D*."""
        fit, loo, d_star, dense_ppl = self.fit, self.leave_one_out, self.tokens_to_reach_dense, self.dense_ppl
        out = [
            "token scaling law (method.md §7): ln ppl = A + B / D^β, D in billions of tokens, "
            f"β = {fit.beta:g} fixed",
            f"{'tokens':>10} {'ppl':>10} {'fitted':>10}  source",
        ]
        for p in sorted(self.points, key=lambda q: q.tokens_billions):
            out.append(f"{format_billions(p.tokens_billions):>10} {p.ppl:>10.3f} "
                       f"{fit.predict_ppl(p.tokens_billions):>10.3f}  {p.source}")
        out.append(f"A  = {fit.A:.6f}   (asymptote exp(A) = {fit.asymptote_ppl:.3f} ppl)")
        out.append(f"B  = {fit.B:.6f}")
        out.append(f"R² = {fit.r2:.6f}   ({fit.n_points} points)")
        if loo:
            out.append(f"leave-one-out: without D = {format_billions(loo.tokens_billions)}, predicted ppl "
                       f"{loo.predicted_ppl:.3f} vs actual {loo.actual_ppl:.3f} "
                       f"(error {100 * loo.relative_error:+.2f}%)")
        else:
            out.append(f"leave-one-out: n/a ({self.leave_one_out_error})")
        if dense_ppl is None:
            out.append("dense ppl unknown: pass --dense-ppl to get the tokens needed to reach it")
        elif d_star is None:
            why = "B ≤ 0: ppl does not fall with tokens" if fit.B <= 0 else f"the asymptote {fit.asymptote_ppl:.3f} ≥ it"
            out.append(f"dense ppl {dense_ppl:.3f} is not reachable by this fit ({why})")
        else:
            out.append(f"dense ppl {dense_ppl:.3f} reached at D* = {d_star:.4g} billion tokens "
                       f"({format_billions(d_star)})")
        if self.plot is not None:
            out.append(f"plot: {self.plot}")
        return out


def fit_report(points: list[Point], dense_ppl: float | None = None, beta: float = CHINCHILLA_BETA, *,
               plot: str | Path | None = None) -> FitReport:
    """Fit the law to ``points`` (a CastError when it cannot be fitted), check it by leave-one-out, compute
    D* for ``dense_ppl`` and, with ``plot``, draw the PNG there."""
    try:
        fit = fit_token_scaling([p.tokens_billions for p in points], [p.ppl for p in points], beta=beta)
    except ValueError as e:
        raise CastError(str(e)) from None
    try:
        loo, loo_error = fit.leave_one_out(), None
    except ValueError as e:
        loo, loo_error = None, str(e)
    d_star = fit.tokens_to_reach(dense_ppl) if dense_ppl is not None else None
    report = FitReport(fit, list(points), dense_ppl, loo, loo_error, d_star)
    if plot:
        report.plot = plot_token_scaling(fit, dense_ppl=dense_ppl, path=plot)
    return report
