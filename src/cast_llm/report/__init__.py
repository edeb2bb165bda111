"""Run reports (``cast-llm report RUN_DIR [RUN_DIR…]``): Markdown / HTML with PNG plots of training
curves, validation perplexity, mask-learning dynamics and the final evaluation tables."""

from cast_llm.report.build import ReportFiles, build_report
from cast_llm.report.runs import Run, load_run, load_runs

__all__ = ["build_report", "ReportFiles", "Run", "load_run", "load_runs"]
