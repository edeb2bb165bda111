"""The sweep of ``cast-llm scaling-law sweep``: one training run per token budget, then the fit of the runs."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from cast_llm.config import parse_count
from cast_llm.errors import CastError
from cast_llm.io import RunDir, atomic_write_text, read_json_object
from cast_llm.scaling.fit import CHINCHILLA_BETA
from cast_llm.scaling.points import load_results, read_runs, write_points_csv
from cast_llm.scaling.report import FitReport, fit_report
from cast_llm.train.checkpoint import list_checkpoints

__all__ = ["SWEEP_OWNED", "format_count", "parse_budgets", "run_command", "train_command", "run_sweep", "sweep"]

# the sweep sets these itself; a copy among the pass-through options would silently fight with it
SWEEP_OWNED = ("--tokens", "--max-steps", "--output-dir", "--resume", "--overwrite")


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
            if not RunDir(run_dir).marker.is_file():
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




SWEEP_MARKER = "cast_sweep.json"  # written last: the files the sweep wrote into --output-dir, and only those
SWEEP_FILES = ("points.csv", "scaling.json", "scaling.png")


def check_sweep_outputs(output_dir: Path, plot: str | Path | None = None) -> list[str]:
    """The names the fit will write into ``output_dir``; a CastError (before any training) when one of them is
    there and was not written by a sweep (not in the folder's :data:`SWEEP_MARKER`), or is a link."""
    import os


    names = [n for n in SWEEP_FILES if not (n == "scaling.png" and plot)]
    marker = output_dir / SWEEP_MARKER
    ours: list = []
    if os.path.lexists(marker):
        ours = read_json_object(marker, "the scaling-law sweep's marker",
                                fix="move it away or choose another --output-dir").get("files", [])
    links = [n for n in names if (output_dir / n).is_symlink()]
    foreign = [n for n in names if os.path.lexists(output_dir / n) and n not in ours]
    if links or foreign:
        bad = sorted(set(links) | set(foreign))
        raise CastError(f"--output-dir {output_dir} holds {', '.join(bad)}, which the scaling-law sweep did not write "
                        f"and would replace; move {'it' if len(bad) == 1 else 'them'} away or choose another --output-dir")
    return names


def sweep(budgets: list[int], output_dir: Path, train_args: list[str], *, metric: str = "wikitext2",
          metric_given: bool = False, dense_ppl: float | None = None, beta: float = CHINCHILLA_BETA,
          plot: str | Path | None = None, dry_run: bool = False, log=print,
          runner: Callable[[list[str]], int] | None = None) -> FitReport | None:
    """Train every budget (:func:`run_sweep`), then fit the finished runs: writes ``points.csv``,
    ``scaling.png`` (or ``plot``) and ``scaling.json`` into ``output_dir``. None with ``dry_run``."""
    names = check_sweep_outputs(output_dir, plot)  # before hours of training, not after
    runs = run_sweep(budgets, output_dir, train_args, runner=runner, dry_run=dry_run, log=log)
    if dry_run:
        return None
    check_sweep_outputs(output_dir, plot)  # (and again: the folder may have changed meanwhile)
    points, dense = read_runs(runs, metric, metric_given, note=log)
    log(f"points: {write_points_csv(points, output_dir / 'points.csv')}")
    report = fit_report(points, dense_ppl if dense_ppl is not None else dense, beta,
                        plot=plot or output_dir / "scaling.png")
    atomic_write_text(output_dir / "scaling.json", json.dumps(report.to_dict(), indent=2) + "\n")
    atomic_write_text(output_dir / SWEEP_MARKER, json.dumps({"written_by": "cast-llm scaling-law sweep",
                                                             "files": names}, indent=2) + "\n")
    return report
