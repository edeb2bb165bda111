"""``cast-llm plan``: what a CAST run will need before it runs — memory per GPU term by term, whether it
fits and with which options, how long it takes, and whether the decay will finish (the library: ``cast_llm.plan``).

From the model's config alone (a folder, config.json, hub id, or an embedded config for offline use): no
weights are loaded. It takes the flags of ``cast-llm train`` (and its ``--preset`` and ``--config``), so the
run it plans is the run those flags launch, plus what only the plan asks (the GPUs, their memory and links);
a flag typed that does not change the plan is refused. Without a preset or config file it plans train's
``--preset llama`` (the paper's LLaMA recipe). Example:
``cast-llm plan --model meta-llama/Llama-3.1-8B --gpus 8 --gpu-memory 80GB``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from cast_llm.cli.options import add_config_command, resolve_options

PLANNED_RUN_DIR = "(planned, not created)"  # the plan writes nothing: the run folder train needs is never made
BASE_PRESET = "llama"  # what `cast-llm plan` plans when no --preset or --config says otherwise


def build_config(args: argparse.Namespace):
    """``(run, options)``: the training configuration as ``cast-llm train`` would resolve it (lowest first:
    train's ``--preset llama`` unless a ``--preset`` or ``--config`` is given, then those, then the flags
    typed) and the plan's own options (from the flags typed only: a preset or config describes the run)."""
    from cast_llm.config import cli_layer, resolve
    from cast_llm.errors import CastError
    from cast_llm.plan.config import PlanOptions
    from cast_llm.train.config import PRESETS, TrainConfig

    if not getattr(args, "model", None) and not getattr(args, "config", None):  # (train's default is a CPU model)
        raise CastError("--model is required (a folder, config.json, hub id or embedded config name)")
    base = {"output_dir": PLANNED_RUN_DIR}
    name = "the plan's default run"
    if not getattr(args, "preset", None) and not getattr(args, "config", None):
        base.update(PRESETS[BASE_PRESET])
        name += f" (train's --preset {BASE_PRESET})"
        if "grad_accum" in cli_layer(args, TrainConfig):  # an explicit accumulation: no global batch overrides it
            del base["global_batch"], base["batch_size"]
    run = resolve_options(TrainConfig, args, presets=PRESETS, one_of=("tokens", "max_steps"), base=(name, base))
    return run, resolve(PlanOptions, ("command line", cli_layer(args, PlanOptions)))


def _text(plan) -> str:
    from cast_llm.plan.report import plan_lines

    return "\n".join(plan_lines(plan)) + json.dumps(plan.as_dict(), default=str)


def make_plan(args: argparse.Namespace):
    """The plan of the flags in ``args``. Refused: a flag typed that does not change the plan (planned again
    without it — with the value the lower layers give — the report is the same although the value differs), and
    an explicit ``--grad-accum`` that the global batch would override."""
    from cast_llm.config import cli_layer
    from cast_llm.errors import CastError
    from cast_llm.plan.config import PlanOptions
    from cast_llm.plan.run import plan_run
    from cast_llm.train.config import TrainConfig

    run, options = build_config(args)
    plan = plan_run(run, options)
    typed = {**cli_layer(args, TrainConfig), **cli_layer(args, PlanOptions)}
    own = {f.name for f in dataclasses.fields(PlanOptions)}  # the plan's own settings; every other flag is the run's

    def setting(run_: TrainConfig, options_: PlanOptions, name: str):
        return getattr(options_ if name in own else run_, name)
    text = _text(plan)

    def unchanged(names: list[str]) -> bool | None:
        """Whether the plan without the flags ``names`` is the same (None: the run needs them, or restates
        the values it has without them)."""
        without = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in names})
        try:
            run2, options2 = build_config(without)
        except CastError:  # the run needs them (its only budget; two that go together)
            return None
        if all(setting(run2, options2, n) == setting(run, options, n) for n in names):
            return None  # the flags restate the values the run has without them
        same_shape = (run2.model, run2.n, run2.m) == (run.model, run.n, run.m)
        try:
            other = plan_run(run2, options2, shape=plan.shape if same_shape else None, framework=plan.setup.framework)
        except CastError:
            return None
        if names == ["gpu_memory"] and other.capacity == plan.capacity:
            return None  # the flag restates the memory the plan assumes without it (80GB)
        return _text(other) == text

    names = [n for n in typed if n not in ("json", "model")]  # how the plan is printed; what is planned
    verdicts = {n: unchanged([n]) for n in names}
    idle = [n for n, same in verdicts.items() if same]
    together = [n for n, same in verdicts.items() if same is None and n in typed and typed[n] is not None]
    if len(together) > 1 and unchanged(together):  # flags that only go together (--regrow-factor/-fraction)
        idle += together
    if idle:
        shown = []
        for name in idle:
            flag, value = "--" + name.replace("_", "-"), typed[name]
            shown.append((flag if value else f"--no-{flag[2:]}") if isinstance(value, bool) else f"{flag} {value}")
        one = len(idle) == 1
        raise CastError(f"{', '.join(shown)} {'does' if one else 'do'} not change this run's plan (the same without "
                        f"{'it' if one else 'them'}): leave {'it' if one else 'them'} out (a --config file may hold "
                        f"{'it' if one else 'them'})")
    if "grad_accum" in typed and plan.setup.grad_accum != run.grad_accum:
        raise CastError(f"--grad-accum {run.grad_accum} contradicts --global-batch {run.global_batch}, which needs "
                        f"--grad-accum {plan.setup.grad_accum} with --batch-size {plan.setup.batch_size} on "
                        f"{options.gpus} GPU(s); give one of them")
    return plan


def run(args: argparse.Namespace) -> int:
    from cast_llm.plan.report import plan_lines

    plan = make_plan(args)
    if plan.options.json:
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
        preset_help="plan a run with these named hyperparameters (as cast-llm train --preset; default: "
                    f"{BASE_PRESET}, unless --config is given)",
        help="memory, time and decay forecast of a run, before running it",
        description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", "'"))
    add_arguments(p, PlanOptions, sections=SECTIONS)
