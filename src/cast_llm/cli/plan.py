"""``cast-llm plan``: what a CAST run will need before it runs — memory per GPU term by term, whether it
fits and with which options, how long it takes, and whether the decay will finish (the library: ``cast_llm.plan``).

From the model's config alone (a folder, config.json, hub id, or an embedded config for offline use): no
weights are loaded. Example: ``cast-llm plan --model meta-llama/Llama-3.1-8B --gpus 8 --gpu-memory 80GB``.
"""

from __future__ import annotations

import argparse
import json

from cast_llm.cli.options import resolve_options, summary
from cast_llm.config import add_arguments


def run(args: argparse.Namespace) -> int:
    from cast_llm.plan import PlanConfig, make_plan
    from cast_llm.plan.report import plan_lines

    cfg = resolve_options(PlanConfig, args)
    plan = make_plan(cfg)
    if cfg.json:
        print(json.dumps(plan.as_dict(), indent=2, default=str))
    else:
        print("\n".join(plan_lines(plan)))
    return 0


def register(sub) -> None:
    from cast_llm.plan.config import SECTIONS, PlanConfig

    p = sub.add_parser("plan", help="memory, time and decay forecast of a run, before running it",
                       description=summary(__doc__))
    add_arguments(p, PlanConfig, sections=SECTIONS)
    p.set_defaults(func=run)
