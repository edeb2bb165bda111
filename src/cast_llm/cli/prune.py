"""``cast-llm prune``: one-shot N:M pruning with magnitude, Wanda or SparseGPT (method.md §6).

Loads a dense model, optionally measures its perplexity on a text file, prunes every target once, measures
again, and writes a verified N:M Hugging Face checkpoint whose ``sparsity`` metadata names the method and
its calibration settings. The settings: :class:`cast_llm.prune.config.PruneConfig`; the job:
:func:`cast_llm.jobs.prune.prune_job`.
"""

from __future__ import annotations

import argparse

from cast_llm.cli.options import add_config_command, resolve_options
from cast_llm.prune.config import METHODS, SECTIONS, PruneConfig

__all__ = ["METHODS", "register", "run"]


def register(subparsers) -> None:
    add_config_command(subparsers, "prune", PruneConfig, func=run, config_file=True, sections=SECTIONS,
                       help="one-shot N:M pruning (magnitude, Wanda, SparseGPT)",
                       description="Prune a dense model to N:M in one shot and write a verified sparse checkpoint.")


def run(args: argparse.Namespace) -> int:
    cfg = resolve_options(PruneConfig, args)
    from cast_llm.jobs.prune import prune_job  # here, not above: `cast-llm --help` imports no torch

    prune_job(cfg)
    return 0
