"""The scaling law's picture: the points, the fitted curve, the dense perplexity and D*."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cast_llm.scaling.fit import TokenScalingFit, format_billions

__all__ = ["plot_token_scaling"]


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
