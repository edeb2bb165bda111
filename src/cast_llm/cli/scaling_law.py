"""``cast-llm scaling``: the token scaling law of method.md §7 from measured points.

``scaling fit INPUT...`` reads points from CSV files and/or finished training run folders and fits
``ln ppl = A + B / D^β``. ``scaling sweep`` trains one run per token budget (``cast-llm train`` in a
subprocess, one after the other), skips budgets already finished, writes ``points.csv`` and fits.

CSV files: a header with a ``ppl`` (or ``perplexity``) column and either ``tokens`` - raw token counts,
suffixes allowed (``20000000``, ``20M``, ``1.5B``) - or ``tokens_billions`` (``0.02``). Other columns are
ignored. Run folders: ``results.json`` as ``cast-llm train`` writes it; the point is
``(tokens_trained, perplexity[METRIC]["sparse"])`` and ``perplexity[METRIC]["dense"]`` supplies the dense ppl
when ``--dense-ppl`` is not given.
"""

from __future__ import annotations

import csv
import json
import math
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cast_llm.config import add_arguments, cli_layer, option, parse_count, resolve
from cast_llm.errors import CastError

METRICS = ("wikitext2", "heldout")
# the sweep sets these itself; a copy among the pass-through options would silently fight with it
SWEEP_OWNED = ("--tokens", "--max-steps", "--output-dir", "--resume", "--overwrite")


@dataclass
class FitOptions:
    dense_ppl: float | None = option(
        None, "perplexity of the dense model, for D* (default: from the run folders)"
    )
    beta: float = option(0.2849, "the fixed exponent β of the law (Chinchilla's 0.2849, as in the paper)")
    metric: str = option(
        "wikitext2",
        "which perplexity of a run folder to fit (wikitext2 falls back to heldout "
        "when a run has none, with a note)",
        choices=METRICS,
    )
    plot: str | None = option(None, "write the fitted curve with the points to this PNG")
    json: bool = option(False, "print the result as one JSON object")


@dataclass
class SweepOptions(FitOptions):
    tokens: str | None = option(None, "comma-separated token budgets, e.g. 1M,2M,4M (at least 3)")
    output_dir: str | None = option(
        None, "folder of the sweep: one run folder per budget, points.csv, the fit"
    )
    dry_run: bool = option(False, "print the training commands without running them")


@dataclass(frozen=True)
class Point:
    tokens_billions: float
    ppl: float
    source: str


# ---------------------------------------------------------------- reading points


def read_points_csv(path: Path) -> list[Point]:
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


# ---------------------------------------------------------------- fit and report


def fit_and_report(
    points: list[Point], dense_ppl: float | None, beta: float, plot: str | None, as_json: bool, out=print
) -> dict:
    from cast_llm.scaling import fit_token_scaling, format_billions, plot_token_scaling

    try:
        fit = fit_token_scaling([p.tokens_billions for p in points], [p.ppl for p in points], beta=beta)
    except ValueError as e:
        raise CastError(str(e)) from None
    try:
        loo, loo_error = fit.leave_one_out(), None
    except ValueError as e:
        loo, loo_error = None, str(e)
    d_star = fit.tokens_to_reach(dense_ppl) if dense_ppl is not None else None
    report = {
        "fit": fit.to_dict(),
        "leave_one_out": loo.to_dict() if loo else None,
        "leave_one_out_error": loo_error,
        "dense_ppl": dense_ppl,
        "dense_reachable": d_star is not None,
        "tokens_to_reach_dense_billions": None if d_star is None or math.isinf(d_star) else d_star,
        "points": [{"tokens_billions": p.tokens_billions, "ppl": p.ppl, "source": p.source} for p in points],
    }
    if plot:
        report["plot"] = str(plot_token_scaling(fit, dense_ppl=dense_ppl, path=plot))
    if as_json:
        out(json.dumps(report, indent=2))
        return report
    out(
        "token scaling law (method.md §7): ln ppl = A + B / D^β, D in billions of tokens, "
        f"β = {fit.beta:g} fixed"
    )
    out(f"{'tokens':>10} {'ppl':>10} {'fitted':>10}  source")
    for p in sorted(points, key=lambda q: q.tokens_billions):
        out(
            f"{format_billions(p.tokens_billions):>10} {p.ppl:>10.3f} "
            f"{fit.predict_ppl(p.tokens_billions):>10.3f}"
            f"  {p.source}"
        )
    out(f"A  = {fit.A:.6f}   (asymptote exp(A) = {fit.asymptote_ppl:.3f} ppl)")
    out(f"B  = {fit.B:.6f}")
    out(f"R² = {fit.r2:.6f}   ({fit.n_points} points)")
    if loo:
        out(
            f"leave-one-out: without D = {format_billions(loo.tokens_billions)}, "
            f"predicted ppl {loo.predicted_ppl:.3f}"
            f" vs actual {loo.actual_ppl:.3f} (error {100 * loo.relative_error:+.2f}%)"
        )
    else:
        out(f"leave-one-out: n/a ({loo_error})")
    if dense_ppl is None:
        out("dense ppl unknown: pass --dense-ppl to get the tokens needed to reach it")
    elif d_star is None:
        why = (
            "B ≤ 0: ppl does not fall with tokens"
            if fit.B <= 0
            else f"the asymptote {fit.asymptote_ppl:.3f} ≥ it"
        )
        out(f"dense ppl {dense_ppl:.3f} is not reachable by this fit ({why})")
    else:
        out(
            f"dense ppl {dense_ppl:.3f} reached at D* = {d_star:.4g} billion tokens "
            f"({format_billions(d_star)})"
        )
    if plot:
        out(f"plot: {report['plot']}")
    return report


# ---------------------------------------------------------------- sweep


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
    runner: Callable[[list[str]], int] = run_command,
    dry_run: bool = False,
    log=print,
) -> list[Path]:
    """Train one run per budget, in order, into ``output_dir/tokens-<budget>``; returns the run folders.

    A budget whose folder holds a finished ``results.json`` is skipped; an unfinished run is resumed from
    its last checkpoint, or restarted (``--overwrite``) when it has none.
    """
    bad = [a for a in train_args if a.split("=")[0] in SWEEP_OWNED]
    if bad:
        raise CastError(
            f"the sweep sets {', '.join(SWEEP_OWNED)} itself: remove {' '.join(bad)} from the "
            "training options after --"
        )
    from cast_llm.train.checkpoint import list_checkpoints

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
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tokens", "ppl", "run"])
        for p in points:
            w.writerow([round(p.tokens_billions * 1e9), repr(p.ppl), p.source])
    return path


# ---------------------------------------------------------------- commands


def run_fit(args) -> int:
    cfg = resolve(FitOptions, ("command line", cli_layer(args, FitOptions)))
    say = (lambda s: print(s, file=sys.stderr)) if cfg.json else print
    points, dense = collect(args.inputs, cfg.metric, "metric" in cli_layer(args, FitOptions), note=say)
    fit_and_report(
        points, cfg.dense_ppl if cfg.dense_ppl is not None else dense, cfg.beta, cfg.plot, cfg.json
    )
    return 0


def run_sweep_command(args) -> int:
    cfg = resolve(SweepOptions, ("command line", cli_layer(args, SweepOptions)))
    if not cfg.output_dir:
        raise CastError("--output-dir is required: the sweep writes one run folder per budget there")
    say = (lambda s: print(s, file=sys.stderr)) if cfg.json else print
    if not cfg.tokens:
        raise CastError("--tokens is required: the budgets to train, e.g. --tokens 5M,10M,20M,40M")
    budgets, out = parse_budgets(cfg.tokens), Path(cfg.output_dir)
    runs = run_sweep(
        budgets, out, list(args.train_args), runner=run_command, dry_run=cfg.dry_run, log=say
    )  # run_command looked up now, so tests can stand a fake trainer in
    if cfg.dry_run:
        return 0
    points, dense = read_runs(runs, cfg.metric, "metric" in cli_layer(args, SweepOptions), note=say)
    say(f"points: {write_points_csv(points, out / 'points.csv')}")
    report = fit_and_report(
        points,
        cfg.dense_ppl if cfg.dense_ppl is not None else dense,
        cfg.beta,
        cfg.plot or str(out / "scaling.png"),
        cfg.json,
    )
    (out / "scaling.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "scaling",
        help="token scaling law: fit ln ppl = A + B/D^β, sweep token budgets",
        description=__doc__.split("\n\n")[0].replace("``", "'"),
    )
    sub = p.add_subparsers(dest="scaling_command", metavar="ACTION")
    fit = sub.add_parser(
        "fit",
        help="fit the law to CSV points and/or finished run folders",
        description="Fit ln ppl = A + B / D^β (β fixed) and report R², a leave-one-out "
        "prediction of the largest budget and the tokens D* needed to reach the dense ppl.",
    )
    fit.add_argument(
        "inputs",
        nargs="+",
        metavar="POINTS.csv|RUN_DIR",
        help="CSV with columns tokens (raw counts, 20M allowed) or tokens_billions, and ppl; "
        "or a finished run folder (results.json)",
    )
    add_arguments(fit, FitOptions)
    fit.set_defaults(func=run_fit)
    sweep = sub.add_parser(
        "sweep",
        help="train at several token budgets, then fit",
        description="Run `cast-llm train ... --tokens T --output-dir DIR/tokens-T` for every "
        "budget, one after the other (finished ones are skipped), collect DIR/points.csv and "
        "fit. Training options go after `--`, e.g. `-- --preset smollm2-cpu`.",
    )
    add_arguments(sweep, SweepOptions)
    sweep.add_argument(
        "train_args",
        nargs="*",
        metavar="-- TRAIN_OPTIONS",
        help="options passed to every `cast-llm train` run",
    )
    sweep.set_defaults(func=run_sweep_command)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
