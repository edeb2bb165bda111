"""``cast-llm eval``: the evaluation command group (method.md §7).

Each kind of evaluation is its own module exposing ``register(eval_subparsers)``, which adds one
sub-command (``cast-llm eval ppl``, ``cast-llm eval zeroshot``) whose parser sets ``func``. A module that
is not written yet is left out, exactly as :mod:`cast_llm.cli` does for top-level commands.
"""

from __future__ import annotations

import argparse
import importlib

# sub-command modules, in the order --help lists them
EVAL_MODULES = [
    "cast_llm.cli.eval_ppl",
    "cast_llm.cli.eval_zeroshot",
]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a model: perplexity, zero-/few-shot accuracy",
        description="Evaluate a model (a checkpoint folder, a .gguf file, a hub id or an alias) "
        "as the paper does (method.md §7).",
    )
    sub = parser.add_subparsers(dest="eval_command", metavar="EVALUATION")
    for name in EVAL_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # not built yet: leave it out of the CLI
                continue
            raise
        module.register(sub)
    parser.set_defaults(func=_usage(parser))


def _usage(parser: argparse.ArgumentParser):
    def show(args) -> int:  # `cast-llm eval` alone: list the evaluations, exit 2 like a usage error
        parser.print_help()
        return 2

    return show
