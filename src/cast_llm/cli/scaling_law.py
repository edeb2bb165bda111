"""``cast-llm scaling-law``: the token scaling law of method.md §7 from measured points.

``scaling-law fit INPUT...`` reads points from CSV files and/or finished training run folders and fits
``ln ppl = A + B / D^β``. ``scaling-law sweep`` trains one run per token budget (``cast-llm train`` in a
subprocess, one after the other), skips budgets already finished, writes ``points.csv`` and fits. The work
is done by :mod:`cast_llm.scaling`; this module holds the options and prints.

CSV files: a header with a ``ppl`` (or ``perplexity``) column and either ``tokens`` - raw token counts,
suffixes allowed (``20000000``, ``20M``, ``1.5B``) - or ``tokens_billions`` (``0.02``). Other columns are
ignored. Run folders: ``results.json`` as ``cast-llm train`` writes it; the point is
``(tokens_trained, perplexity[METRIC]["sparse"])`` and ``perplexity[METRIC]["dense"]`` supplies the dense ppl
when ``--dense-ppl`` is not given.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from cast_llm.cli.options import resolve_options, summary
from cast_llm.config import JsonSettings, OutputDirSettings, PlotSettings, add_arguments, cli_layer, option
from cast_llm.errors import CastError

METRICS = ("wikitext2", "heldout")  # = cast_llm.scaling.METRICS, kept here so --help stays fast
CHINCHILLA_BETA = 0.2849  # = cast_llm.scaling.CHINCHILLA_BETA


@dataclass
class FitOptions(JsonSettings, PlotSettings):
    OPTION_TEXT = {"plot": "write the fitted curve with the points to this PNG"}

    dense_ppl: float | None = option(
        None, "perplexity of the dense model, for D* (default: from the run folders)"
    )
    beta: float = option(CHINCHILLA_BETA, "the fixed exponent β of the law (Chinchilla's 0.2849, as in the paper)")
    metric: str = option(
        "wikitext2",
        "which perplexity of a run folder to fit (wikitext2 falls back to heldout "
        "when a run has none, with a note)",
        choices=METRICS,
    )


@dataclass
class SweepOptions(OutputDirSettings, FitOptions):
    """The fit's options, the budgets and the sweep's folder (no --overwrite: each run folder in it is resumed or
    started afresh by the run itself)."""

    OPTION_TEXT = {"output_dir": "folder of the sweep: one run folder per budget, points.csv, the fit"}

    budgets: str | None = option(None, "comma-separated training-token budgets, e.g. 1M,2M,4M (at least 3)")
    dry_run: bool = option(False, "print the training commands without running them")


def _print_report(report, as_json: bool) -> None:
    print(json.dumps(report.to_dict(), indent=2) if as_json else "\n".join(report.lines()))


def run_fit(args) -> int:
    from cast_llm import scaling as scaling_law

    cfg = resolve_options(FitOptions, args)
    say = (lambda s: print(s, file=sys.stderr)) if cfg.json else print
    points, dense = scaling_law.collect(args.inputs, cfg.metric, "metric" in cli_layer(args, FitOptions), note=say)
    report = scaling_law.fit_report(points, cfg.dense_ppl if cfg.dense_ppl is not None else dense, cfg.beta,
                                    plot=cfg.plot)
    _print_report(report, cfg.json)
    return 0


def run_sweep_command(args) -> int:
    from cast_llm import scaling as scaling_law

    cfg = resolve_options(SweepOptions, args)
    if not cfg.output_dir:
        raise CastError("--output-dir is required: the sweep writes one run folder per budget there")
    say = (lambda s: print(s, file=sys.stderr)) if cfg.json else print
    if not cfg.budgets:
        raise CastError("--budgets is required: the training-token budgets, e.g. --budgets 5M,10M,20M,40M")
    report = scaling_law.sweep(
        scaling_law.parse_budgets(cfg.budgets), Path(cfg.output_dir), list(args.train_args), metric=cfg.metric,
        metric_given="metric" in cli_layer(args, SweepOptions), dense_ppl=cfg.dense_ppl, beta=cfg.beta,
        plot=cfg.plot, dry_run=cfg.dry_run, log=say,
    )
    if report is not None:
        _print_report(report, cfg.json)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "scaling-law",
        help="token scaling law: fit ln ppl = A + B/D^β, sweep token budgets",
        description=summary(__doc__),
    )
    sub = p.add_subparsers(dest="scaling_law_command", metavar="ACTION")
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
