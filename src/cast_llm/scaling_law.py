"""The token scaling law of method.md §7: how perplexity falls with the number of training tokens.

    L(D) = A + B / D^β,   L = ln(ppl),   D = training tokens in billions,   β = 0.2849 fixed (Chinchilla)

With β fixed the law is linear in ``x = D^−β``, so A (intercept) and B (slope) come from an ordinary
least-squares regression of L on x. From the fit:

- ``predict_ppl(D) = exp(A + B·D^−β)``; the asymptote ``exp(A)`` is the ppl an infinite budget reaches;
- ``tokens_to_reach(ppl*) = (B / (ln ppl* − A))^{1/β}`` billions, the paper's D* (with ppl* the dense
  model's ppl: the budget at which the sparse model is predicted to match it);
- ``leave_one_out()``: fit without the largest budget and predict it - an honest check of the extrapolation
  that D* relies on.

Around the fit (what ``cast-llm scaling-law`` runs): points from CSV files (:func:`read_points_csv`) and
finished run folders (:func:`read_runs`), the fit with its report (:func:`fit_report`), and the sweep that
trains one run per token budget (:func:`run_sweep`, :func:`sweep`). Not to be confused with the learnable
*weight* scaling of Eq. 11-12 (:mod:`cast_llm.nn.scaled_linear`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cast_llm.config import parse_count
from cast_llm.errors import CastError
from cast_llm.io import atomic_write_text
from cast_llm.train.checkpoint import list_checkpoints

CHINCHILLA_BETA = 0.2849
METRICS = ("wikitext2", "heldout")  # the perplexities of a run folder's results.json that can be fitted
# the sweep sets these itself; a copy among the pass-through options would silently fight with it
SWEEP_OWNED = ("--tokens", "--max-steps", "--output-dir", "--resume", "--overwrite")


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


# ---------------------------------------------------------------- points: CSV files and run folders


@dataclass(frozen=True)
class Point:
    """One measured point: training tokens (billions), perplexity, and where it was read."""

    tokens_billions: float
    ppl: float
    source: str


# ---------------------------------------------------------------- reading points


def read_points_csv(path: Path) -> list[Point]:
    """Points of a CSV file: a ``ppl`` (or ``perplexity``) column and ``tokens`` (raw counts, ``20M``
    allowed) or ``tokens_billions``; other columns are ignored."""
    try:
        rows = list(csv.DictReader(path.read_text(encoding="utf-8").splitlines()))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise CastError(f"cannot read {path}: {e}") from None
    if not rows:
        raise CastError(
            f"{path} holds no points (expected a header such as 'tokens,ppl' and one row per run)"
        )
    header = {k.strip().lower(): k for k in rows[0] if k}
    ppl_col = header.get("ppl") or header.get("perplexity")
    tok_col, in_billions = (
        (header["tokens_billions"], True) if "tokens_billions" in header else (header.get("tokens"), False)
    )
    if ppl_col is None or tok_col is None:
        raise CastError(
            f"{path}: needs a 'ppl' column and a 'tokens' (raw counts, 20M allowed) or "
            f"'tokens_billions' column; found {', '.join(header) or 'none'}"
        )
    points = []
    for i, row in enumerate(rows, start=2):  # line 1 is the header
        t, p = (row.get(tok_col) or "").strip(), (row.get(ppl_col) or "").strip()
        if not t and not p:
            continue
        try:
            d = float(t) if in_billions else parse_count(t) / 1e9
            ppl = float(p)
        except ValueError as e:
            raise CastError(f"{path}, line {i}: {e}") from None
        points.append(Point(d, ppl, f"{path}:{i}"))
    return points


def _ppl(results: dict, metric: str, model: str = "sparse") -> float | None:
    """``results["perplexity"][metric][model]`` as a float, None when absent (e.g. no WikiText-2 file)."""
    v = (results.get("perplexity") or {}).get(metric) or {}
    v = v.get(model) if isinstance(v, dict) else None
    if isinstance(v, dict):  # tolerate a full PplResult dict
        v = v.get("perplexity")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def load_results(run_dir: Path) -> dict | None:
    """``results.json`` of a *finished* run (tokens_trained and a sparse ppl present), else None."""
    f = run_dir / "results.json"
    if not f.is_file():
        return None
    try:
        results = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    finished = (
        isinstance(results, dict)
        and isinstance(results.get("tokens_trained"), int)
        and any(_ppl(results, m) is not None for m in METRICS)
    )
    return results if finished else None


def read_runs(
    run_dirs: list[Path], metric: str, metric_given: bool, note=print
) -> tuple[list[Point], float | None]:
    """Points and the dense ppl (median over runs; None if absent) of finished run folders, one metric
    for all of them."""
    results = []
    for r in run_dirs:
        res = load_results(r)
        if res is None:
            why = "holds no results.json" if not (r / "results.json").is_file() else "has not finished"
            raise CastError(f"run folder {r} {why}: finish it (or `cast-llm train --resume`) before fitting")
        results.append((r, res))
    missing = [r for r, res in results if _ppl(res, metric) is None]
    if (
        missing
        and not metric_given
        and metric == "wikitext2"
        and all(_ppl(res, "heldout") is not None for _, res in results)
    ):
        note(
            f"note: {len(missing)} run(s) have no WikiText-2 perplexity (e.g. {missing[0]}); "
            "fitting the held-out perplexity of every run instead (a --dense-ppl must then be held-out too)"
        )
        metric, missing = "heldout", []
    if missing:
        raise CastError(
            f"run folder {missing[0]} has no '{metric}' sparse perplexity in results.json; "
            f"choose the metric all runs have with --metric ({', '.join(METRICS)})"
        )
    points = [Point(res["tokens_trained"] / 1e9, _ppl(res, metric), str(r)) for r, res in results]
    # every run measures the same dense model before training: take the median in case evaluations differ
    dense = sorted(v for _, res in results if (v := _ppl(res, metric, "dense")) is not None)
    return points, (dense[len(dense) // 2] if dense else None)


def collect(
    inputs: list[str], metric: str, metric_given: bool, note=print
) -> tuple[list[Point], float | None]:
    """Points (and the dense ppl of the run folders) of every input: CSV files and finished run folders."""
    points, runs = [], []
    for s in inputs:
        p = Path(s)
        if p.is_dir():
            runs.append(p)
        elif p.is_file():
            points += read_points_csv(p)
        else:
            raise CastError(f"{p} does not exist (pass CSV files of tokens,ppl or training run folders)")
    dense = None
    if runs:
        run_points, dense = read_runs(runs, metric, metric_given, note)
        points += run_points
    return points, dense


# ---------------------------------------------------------------- the fit and its report


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


# ---------------------------------------------------------------- the sweep

def format_count(n: int) -> str:
    """20_000_000 -> '20M', 1_500_000 -> '1.5M', 1_250_000 -> '1250k', 12345 -> '12345': at most one decimal,
    and exact, so that a run folder's name maps back to its budget."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale and n % (scale // 10) == 0:
            return f"{n / scale:g}{unit}"
    return str(n)


def parse_budgets(spec: str) -> list[int]:
    try:
        budgets = sorted({parse_count(s) for s in spec.split(",") if s.strip()})
    except ValueError as e:
        raise CastError(f"--tokens: {e}") from None
    if any(b <= 0 for b in budgets) or len(budgets) < 3:
        raise CastError(
            f"--tokens needs at least 3 distinct positive budgets (the fit has 3 points at least), "
            f"got {spec!r}"
        )
    return budgets


def run_command(cmd: list[str]) -> int:
    """Run a training command in the foreground, its output going to ours."""
    return subprocess.run(cmd, check=False).returncode


def train_command(budget: int, run_dir: Path, train_args: list[str], extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "cast_llm.cli",
        "train",
        *train_args,
        "--tokens",
        str(budget),
        "--output-dir",
        str(run_dir),
        *extra,
    ]


def run_sweep(
    budgets: list[int],
    output_dir: Path,
    train_args: list[str],
    *,
    runner: Callable[[list[str]], int] | None = None,
    dry_run: bool = False,
    log=print,
) -> list[Path]:
    """Train one run per budget, in order, into ``output_dir/tokens-<budget>``; returns the run folders.

    A budget whose folder holds a finished ``results.json`` is skipped; an unfinished run is resumed from
    its last checkpoint, or restarted (``--overwrite``) when it has none. ``runner`` runs one training command
    and returns its exit code (default: :func:`run_command`, looked up at the call).
    """
    bad = [a for a in train_args if a.split("=")[0] in SWEEP_OWNED]
    if bad:
        raise CastError(
            f"the sweep sets {', '.join(SWEEP_OWNED)} itself: remove {' '.join(bad)} from the "
            "training options after --"
        )
    runner = runner or run_command
    runs = []
    for i, budget in enumerate(budgets, start=1):
        run_dir = output_dir / f"tokens-{format_count(budget)}"
        runs.append(run_dir)
        if load_results(run_dir) is not None:
            log(f"[{i}/{len(budgets)}] {format_count(budget)} tokens: finished already ({run_dir}), skipped")
            continue
        extra = []
        if run_dir.is_dir() and any(run_dir.iterdir()):
            if not (run_dir / "cast_run.json").is_file():
                raise CastError(
                    f"{run_dir} exists and is not a cast-llm run: move it away or use another --output-dir"
                )
            extra = ["--resume"] if list_checkpoints(run_dir) else ["--overwrite"]
        cmd = train_command(budget, run_dir, train_args, extra)
        log(f"[{i}/{len(budgets)}] {format_count(budget)} tokens: {shlex.join(cmd)}")
        if dry_run:
            continue
        rc = runner(cmd)
        if rc != 0:
            raise CastError(
                f"training for {format_count(budget)} tokens failed (exit code {rc}); fix the cause "
                "and run the same sweep again: finished budgets are skipped, this one resumes from its last "
                "checkpoint (or restarts)"
            )
    return runs


def write_points_csv(points: list[Point], path: Path) -> Path:
    """The points as ``tokens,ppl,run`` rows (what :func:`read_points_csv` reads back)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["tokens", "ppl", "run"])
    for p in points:
        w.writerow([round(p.tokens_billions * 1e9), repr(p.ppl), p.source])
    return atomic_write_text(path, buf.getvalue())


def sweep(budgets: list[int], output_dir: Path, train_args: list[str], *, metric: str = "wikitext2",
          metric_given: bool = False, dense_ppl: float | None = None, beta: float = CHINCHILLA_BETA,
          plot: str | Path | None = None, dry_run: bool = False, log=print,
          runner: Callable[[list[str]], int] | None = None) -> FitReport | None:
    """Train every budget (:func:`run_sweep`), then fit the finished runs: writes ``points.csv``,
    ``scaling.png`` (or ``plot``) and ``scaling.json`` into ``output_dir``. None with ``dry_run``."""
    runs = run_sweep(budgets, output_dir, train_args, runner=runner, dry_run=dry_run, log=log)
    if dry_run:
        return None
    points, dense = read_runs(runs, metric, metric_given, note=log)
    log(f"points: {write_points_csv(points, output_dir / 'points.csv')}")
    report = fit_report(points, dense_ppl if dense_ppl is not None else dense, beta,
                        plot=plot or output_dir / "scaling.png")
    atomic_write_text(output_dir / "scaling.json", json.dumps(report.to_dict(), indent=2) + "\n")
    return report


