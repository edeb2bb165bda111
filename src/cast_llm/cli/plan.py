"""``cast-llm plan``: what a CAST run will need before it runs — memory per GPU term by term, whether it
fits and with which options, how long it takes, and whether the decay will finish (the library: ``cast_llm.plan``).

From the model's config alone (a folder, config.json, hub id, or an embedded config for offline use): no
weights are loaded. It takes every flag of ``cast-llm train`` (and its ``--preset`` and ``--config``), so the
run it plans is the run those flags launch, plus what only the plan asks (the GPUs, their memory and links).
Without a preset, config file or budget it plans the paper's LLaMA recipe. Example:
``cast-llm plan --model meta-llama/Llama-3.1-8B --gpus 8 --gpu-memory 80GB``.
"""

from __future__ import annotations

import argparse
import json

from cast_llm.cli.options import add_config_command, resolve_options


def build_config(args: argparse.Namespace):
    """The plan's input: the training configuration as ``cast-llm train`` would resolve it (lowest first: the
    paper's LLaMA recipe, ``--preset``, ``--config``, the flags typed) and the plan's own options."""
    from cast_llm.config import cli_layer, resolve
    from cast_llm.errors import CastError
    from cast_llm.plan.config import PLAN_BASE, PlanConfig, PlanOptions
    from cast_llm.train.config import PRESETS, TrainConfig

    if not getattr(args, "model", None) and not getattr(args, "config", None):  # (train's default is a CPU model)
        raise CastError("--model is required (a folder, config.json, hub id or embedded config name)")
    run = resolve_options(TrainConfig, args, presets=PRESETS, one_of=("tokens", "max_steps"),
                          base=("the plan's default run (the paper's LLaMA recipe)", PLAN_BASE))
    # the plan's own options come from the flags typed only: --preset and --config describe the run
    return PlanConfig.from_run(run, resolve(PlanOptions, ("command line", cli_layer(args, PlanOptions))))


def run(args: argparse.Namespace) -> int:
    from cast_llm.plan import make_plan
    from cast_llm.plan.report import plan_lines

    cfg = build_config(args)
    plan = make_plan(cfg)
    if cfg.json:
        print(json.dumps(plan.as_dict(), indent=2, default=str))
    else:
        print("\n".join(plan_lines(plan)))
    return 0


def register(sub) -> None:
    from cast_llm.config import add_arguments
    from cast_llm.plan.config import SECTIONS, PlanOptions
    from cast_llm.train.config import PRESETS, TrainConfig
    from cast_llm.train.config import SECTIONS as TRAIN_SECTIONS

    p = add_config_command(
        sub, "plan", TrainConfig, func=run, presets=PRESETS, config_file=True, sections=SECTIONS + TRAIN_SECTIONS,
        preset_help="plan a run with these named hyperparameters (as cast-llm train --preset)",
        help="memory, time and decay forecast of a run, before running it",
        description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", "'"))
    add_arguments(p, PlanOptions, sections=SECTIONS)
