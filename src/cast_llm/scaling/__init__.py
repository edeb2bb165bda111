"""The token scaling law of method.md §7 (``cast-llm scaling-law``), one concern per module:

* :mod:`~cast_llm.scaling.fit` — the pure fit ``ln ppl = A + B / D^β`` and what follows from it (D*, leave-one-out);
* :mod:`~cast_llm.scaling.points` — points from CSV files and finished run folders;
* :mod:`~cast_llm.scaling.report` — a fit with its checks, as text and JSON;
* :mod:`~cast_llm.scaling.plot` — its picture;
* :mod:`~cast_llm.scaling.budget_sweep` — one training run per budget, then the fit.
"""

from cast_llm.scaling.budget_sweep import (
    SWEEP_OWNED,
    format_count,
    parse_budgets,
    run_command,
    run_sweep,
    sweep,
    train_command,
)
from cast_llm.scaling.fit import (
    CHINCHILLA_BETA,
    LeaveOneOut,
    TokenScalingFit,
    fit_token_scaling,
    format_billions,
)
from cast_llm.scaling.plot import plot_token_scaling
from cast_llm.scaling.points import (
    METRICS,
    Point,
    collect,
    load_results,
    read_points_csv,
    read_runs,
    write_points_csv,
)
from cast_llm.scaling.report import FitReport, fit_report

__all__ = ["CHINCHILLA_BETA", "LeaveOneOut", "TokenScalingFit", "fit_token_scaling", "format_billions",
           "plot_token_scaling", "METRICS", "Point", "collect", "load_results", "read_points_csv", "read_runs",
           "write_points_csv", "FitReport", "fit_report", "SWEEP_OWNED", "format_count", "parse_budgets",
           "run_command", "run_sweep", "sweep", "train_command"]
